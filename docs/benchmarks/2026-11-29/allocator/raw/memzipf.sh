#!/bin/bash
# usage: memtest.sh BIN [ENV=VAL...]: 8G volume at 90% in a 1536M cgroup; fill, then seq read 1m qd16 and uniform 4k; prints peak
bin=$1; shift
G=/sys/fs/cgroup/memory/dvtest
[ -d $G ] && rmdir $G; mkdir $G; echo $((1536<<20)) > $G/memory.limit_in_bytes
cd /tmp/p0; rm -f m.img m.sock
$bin format m.img --logical-size 8G --physical-size 6G --force >/dev/null
sync; echo 3 > /proc/sys/vm/drop_caches
(echo $BASHPID > $G/cgroup.procs; exec env "$@" setsid $bin serve m.img --socket /tmp/p0/m.sock --cache-size 1124M > m.log 2>&1) &
for i in $(seq 50); do [ -S m.sock ] && break; sleep 0.2; done
D="--dedupe_percentage=68.4 --dedupe_mode=working_set --dedupe_working_set_percentage=30 --buffer_compress_percentage=68.4 --buffer_compress_chunk=4096"
U="nbd+unix:///dedupvol?socket=/tmp/p0/m.sock"
/tmp/w/run.sh "$U" fill $D --size=8G --rw=write --bs=1m --iodepth=8 --end_fsync=1
echo "peak after fill $(( $(cat $G/memory.max_usage_in_bytes) >> 20 )) MiB"
/tmp/w/run.sh "$U" zwarm $D --size=8G --rw=randread --bs=4k --iodepth=32 --random_distribution=zipf:1.1 --time_based --runtime=15 >/dev/null
echo "peak after seq $(( $(cat $G/memory.max_usage_in_bytes) >> 20 )) MiB"
/tmp/w/run.sh "$U" zipf $D --size=8G --rw=randread --bs=4k --iodepth=32 --random_distribution=zipf:1.1 --time_based --runtime=15
echo "peak after zipf $(( $(cat $G/memory.max_usage_in_bytes) >> 20 )) MiB; rss $(grep VmHWM /proc/$(pgrep -f 'serve m.img')/status 2>/dev/null)"
pkill -f "serve m.img"; sleep 1; rmdir $G; rm -f m.img
