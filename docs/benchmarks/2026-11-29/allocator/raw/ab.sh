#!/bin/bash
# usage: JOBS="m r4 s w" ab.sh PCT ROUNDS bin1 bin2 ... ; rounds interleaved
pct=$1; shift; rounds=$1; shift
JOBS=${JOBS:-"m m"}
for r in $(seq $rounds); do for b in "$@"; do
  kill $(cat /tmp/p0/srv.pid) 2>/dev/null; sleep 1
  B=/tmp/p0/$b ./setup.sh $pct >/dev/null
  for j in $JOBS; do
   case $j in
    m) a="--rw=randrw --rwmixread=70 --bsrange=8k-128k --iodepth=16";;
    r) a="--rw=randread --bsrange=8k-128k --iodepth=16";;
    r4) a="--rw=randread --bs=4k --iodepth=32";;
    s) a="--rw=read --bs=1m --iodepth=16";;
    w) a="--rw=randwrite --bsrange=8k-128k --iodepth=16";;
    w4) a="--rw=randwrite --bs=4k --iodepth=32";;
    sql) a="--rw=randrw --rwmixread=68 --percentage_random=80 --bssplit=8k/50:64k/25:128k/25,8k/50:16k/25:96k/25 --iodepth=32";;
   esac
   ./job.sh $b-$j $a | tr '\n' ' '; echo
  done
  echo "$b rss $(grep VmHWM /proc/$(cat /tmp/p0/srv.pid)/status)"
done; done
kill $(cat /tmp/p0/srv.pid) 2>/dev/null
