#!/bin/sh
# Dedup kept by a sparse index against a dense one, on `gen --preset vdi` data and on a
# pair of Linux source tars (imported one after the other, the second at offset 2 GiB).
# Usage: sparse_dense.sh DIR TAR1 TAR2; SETS="tars" leaves the VDI data out.
set -eu
D=${DEDUPVOL:-target/release/dedupvol}
dir=$1; tar1=$2; tar2=$3
sets=${SETS:-vdi tars}
case "$sets" in *vdi*) [ -f "$dir/vdi.bin" ] || $D gen --preset vdi --size 2G -o "$dir/vdi.bin" > /dev/null ;; esac
for mode in dense sparse; do
  for set in $sets; do
    v="$dir/sd-$mode-$set.img"
    $D format "$v" --logical-size 8G --physical-size 8G --index "$mode" --dedup-window 8G --force > /dev/null
    if [ $set = vdi ]; then
      $D import "$v" "$dir/vdi.bin" > /dev/null 2>&1
    else
      $D import "$v" "$tar1" > /dev/null 2>&1
      $D import "$v" "$tar2" --offset 2G > /dev/null 2>&1
    fi
    $D stats "$v" --json | python3 -c "
import json,sys; s=json.load(sys.stdin)
print('$mode', '$set', 'dedup_bytes', s['savings']['dedup_bytes'], 'logical', s['logical_bytes_used'], 'physical', s['physical_data_bytes_used'],
      'index_memory', s['index_memory_bytes'], 'window', s['index']['window_bytes'], 'lookups', s['index']['lookups'], 'hits', s['lifetime']['dedup_hits'])"
    rm -f "$v"
  done
done
