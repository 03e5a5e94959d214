#!/bin/sh
# kill -9 during a 4 GiB ingest, then the same data written again: dedup against a clean
# close of the same amount. Usage: kill9_rewrite.sh DIR [SECONDS_BEFORE_KILL]
set -eu
D=${DEDUPVOL:-target/release/dedupvol}
dir=$1; wait_s=${2:-6}
data="$dir/data4g.bin"
[ -f "$data" ] || $D gen --dup 0 --compress 50 --size 4G -o "$data" > /dev/null
hits() { $D stats "$1" --json | python3 -c "import json,sys; s=json.load(sys.stdin); print(s['lifetime']['dedup_hits'], s['mapped_blocks'] if 'mapped_blocks' in s else s['logical_bytes_used']//4096, s['lifetime']['recoveries'])"; }
v="$dir/k9.img"
$D format "$v" --logical-size 16G --physical-size 12G --dedup-window 8G --force > /dev/null
$D import "$v" "$data" > /dev/null 2>&1 & pid=$!
sleep "$wait_s"; kill -9 $pid; wait $pid 2>/dev/null || true
set -- $(hits "$v"); h0=$1; blocks=$2
echo "crash: import killed after ${wait_s} s; the volume holds $blocks logical blocks after recovery"
t0=$(date +%s.%N)
head -c $((blocks * 4096)) "$data" | $D import "$v" - --offset 8G > /dev/null 2>&1
set -- $(hits "$v"); echo "crash: rewriting those $blocks blocks found $(( $1 - h0 )) duplicates ($(python3 -c "print(f'{($1-$h0)*100/$blocks:.2f}')") %)"
$D check "$v" | tail -2
# The same amount written and closed cleanly, then written again.
c="$dir/k9c.img"
$D format "$c" --logical-size 16G --physical-size 12G --dedup-window 8G --force > /dev/null
head -c $((blocks * 4096)) "$data" | $D import "$c" - > /dev/null 2>&1
set -- $(hits "$c"); h0=$1
head -c $((blocks * 4096)) "$data" | $D import "$c" - --offset 8G > /dev/null 2>&1
set -- $(hits "$c"); echo "clean: rewriting $blocks blocks found $(( $1 - h0 )) duplicates ($(python3 -c "print(f'{($1-$h0)*100/$blocks:.2f}')") %)"
rm -f "$v" "$c"
