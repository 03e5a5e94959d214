#!/usr/bin/env bash
# A/B comparison of two dedupvol binaries on `bench --mode targets`, interleaved
# (base, new, base, new, ...) so that slow drifts of the machine hit both alike.
#
#   scripts/ab-targets.sh BASE_BIN NEW_BIN [ROUNDS [OUTDIR]]
#
# ROUNDS defaults to 2; OUTDIR to /var/tmp/ab-<UTC timestamp>. Each run's full output is
# kept as OUTDIR/{base,new}-runN.txt; the summary table (engine figure of every run, the
# no-reduction volume's range, the disk figure) is printed and saved as OUTDIR/summary.txt.
# Scratch volumes go to OUTDIR/scratch (a few GiB while a run lasts; removed after each run).
# AB_FILE=PATH adds the real-file scenario (`--file`, e.g. a kernel source tar).
set -euo pipefail

usage() { echo "usage: $0 BASE_BIN NEW_BIN [ROUNDS [OUTDIR]]" >&2; exit 2; }
(($# >= 2 && $# <= 4)) || usage
base_bin=$(realpath "$1")
new_bin=$(realpath "$2")
rounds=${3:-2}
outdir=${4:-/var/tmp/ab-$(date -u +%Y%m%dT%H%M%SZ)}
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "ab-targets: ROUNDS must be a positive integer, not '$rounds'" >&2; exit 2; }
for b in "$base_bin" "$new_bin"; do
  [[ -x "$b" ]] || { echo "ab-targets: $b is not an executable" >&2; exit 2; }
done

mkdir -p "$outdir"
scratch="$outdir/scratch"
cleanup() { rm -rf "$scratch"; }
trap cleanup EXIT

# The bench writes volumes of a few GiB (the 4 KiB overwrite scenario prefills 4 GiB of
# logical range); refuse to start on a nearly full file system rather than fail midway.
avail_kib=$(df -Pk "$outdir" | awk 'NR==2 {print $4}')
if ((avail_kib < 8 * 1024 * 1024)); then
  echo "ab-targets: only $((avail_kib / 1024)) MiB free under $outdir; the bench needs about 8 GiB" >&2
  exit 1
fi

here=$(dirname "$(realpath "$0")")
file_args=()
[[ -n "${AB_FILE:-}" ]] && file_args=(--file "$(realpath "$AB_FILE")")
{
  echo "base: $base_bin ($(sha256sum "$base_bin" | cut -c1-16))"
  echo "new:  $new_bin ($(sha256sum "$new_bin" | cut -c1-16))"
  echo "rounds: $rounds, started $(date -u +%FT%TZ)"
} | tee "$outdir/runs.txt"

for ((r = 1; r <= rounds; r++)); do
  for side in base new; do
    bin=$base_bin; [[ $side == new ]] && bin=$new_bin
    out="$outdir/$side-run$r.txt"
    rm -rf "$scratch"; mkdir -p "$scratch"
    echo "ab-targets: round $r/$rounds, $side -> $out" >&2
    start=$(date +%s)
    if ! "$bin" bench --mode targets --dir "$scratch" "${file_args[@]}" >"$out" 2>"$outdir/$side-run$r.err"; then
      echo "ab-targets: $side run $r failed; see $outdir/$side-run$r.err" >&2
      exit 1
    fi
    echo "ab-targets: $side run $r took $(($(date +%s) - start)) s" >&2
  done
done
rm -rf "$scratch"

python3 "$here/ab_targets.py" "$outdir" | tee "$outdir/summary.txt"
