#!/bin/bash
# usage: setup.sh PCT  -> formats v.img, starts server (pid in srv.pid), fills region
pct=$1
B=${B:-/work/main/target/release/dedupvol}
cd /tmp/p0; rm -f dv.sock v.img
$B format v.img --logical-size 2G --physical-size 4G --force >/dev/null
(setsid $B serve v.img --socket /tmp/p0/dv.sock $EXTRA > srv.log 2>&1 & echo $! > srv.pid)
for i in $(seq 50); do [ -S dv.sock ] && break; sleep 0.2; done
if [ "$pct" = 90 ]; then D="--dedupe_percentage=68.4 --dedupe_mode=working_set --dedupe_working_set_percentage=31 --buffer_compress_percentage=68.4 --buffer_compress_chunk=4096"; else D=""; fi
echo "$D" > dopts
/tmp/w/run.sh "nbd+unix:///dedupvol?socket=/tmp/p0/dv.sock" fill $D --rw=write --bs=1m --iodepth=8 --end_fsync=1
