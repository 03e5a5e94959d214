#!/usr/bin/env bash
# Write-once journaling benchmark: ext4 data=journal on a served volume (nbdfuse + loop
# mount), under no reduction, BLAKE3 dedup, WOJ alone and both; prints markdown tables.
# Needs root, nbdfuse, fusermount3, mkfs.ext4. Options: see scripts/bench_woj.py --help
# (--quick: small sizes, for a smoke run).
set -euo pipefail
cd "$(dirname "$0")/.."
args=()
for a in "$@"; do
  if [ "$a" = "--quick" ]; then
    args+=(--seq-mib 8 --rand-file-mib 32 --rand-writes 2048 --tree /usr/share/doc --sqlite-txns 30 --size 1G)
  else
    args+=("$a")
  fi
done
nice -n 19 cargo build --release -p dedupvol-cli >&2
exec nice -n 19 python3 scripts/bench_woj.py "${args[@]}"
