#!/usr/bin/env bash
# dedupvol read benchmarks, side by side with nbdkit's file plugin (see docs/benchmarks/).
#
#   scripts/bench-reads.sh                          # all sections (~40 min)
#   scripts/bench-reads.sh --sections nbd --levels 0,90 --rounds 2 --runtime 15
#   scripts/bench-reads.sh --sections memory        # equal memory (cgroup v1, root)
#   scripts/bench-reads.sh --sections replay        # trace replay on a throttled loop device (root)
#
# Prints Markdown tables; results.json (every command verbatim) goes to --out
# (default /var/tmp/dedupvol-reads/report).
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
for tool in fio nbdkit losetup; do command -v "$tool" >/dev/null || need+=("$tool"); done
if ((${#need[@]})); then
  pkgs=()
  for t in "${need[@]}"; do case "$t" in losetup) pkgs+=(mount) ;; *) pkgs+=("$t") ;; esac; done
  echo "bench-reads: installing ${pkgs[*]}" >&2
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${pkgs[@]}" >/dev/null
fi
cargo build --release -p dedupvol-cli
exec python3 scripts/bench_reads.py "$@"
