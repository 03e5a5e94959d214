#!/usr/bin/env bash
# dedupvol side-by-side benchmark suite (see docs/workloads.md and docs/benchmarks/).
#
#   scripts/bench-suite.sh --quick        # CI smoke test, under 3 minutes, report in /var/tmp/dedupvol-suite/report
#   scripts/bench-suite.sh                # full run (~30-60 min), report in docs/benchmarks/DATE/
#   scripts/bench-suite.sh --skip ingest  # sections: limits,nbd,targets,overhead,ingest
#
# The full mode installs what only it needs (borgbackup, restic) and downloads
# linux-source-6.1 packages into --cache (default /var/tmp/dedupvol-bench-cache); the
# project's test command never does.
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
for a in "$@"; do [[ "$a" == "--quick" ]] && quick=1; done

need=()
for tool in fio nbdkit qemu-img mke2fs xz; do command -v "$tool" >/dev/null || need+=("$tool"); done
if ((quick == 0)); then
  command -v borg >/dev/null || need+=(borgbackup)
  command -v restic >/dev/null || need+=(restic)
fi
if ((${#need[@]})); then
  pkgs=()
  for t in "${need[@]}"; do
    case "$t" in
      qemu-img) pkgs+=(qemu-utils) ;; mke2fs) pkgs+=(e2fsprogs) ;; xz) pkgs+=(xz-utils) ;; *) pkgs+=("$t") ;;
    esac
  done
  echo "bench-suite: installing ${pkgs[*]}" >&2
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${pkgs[@]}" >/dev/null
fi

cargo build --release -p dedupvol-cli
exec python3 scripts/bench_suite.py "$@"
