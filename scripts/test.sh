#!/usr/bin/env bash
# The project's test command (README.md): installs the real clients the tests drive
# (qemu-img, nbdcopy, nbdinfo, fio, nbdfuse, e2fsck, a one-node Ceph cluster) when missing, then lints
# the core and runs every test. DEDUPVOL_SKIP_RADOS=1 leaves out the tests against Ceph RADOS
# (scripts/test-rados.sh runs them alone); the skip is printed.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
while read -r pkg; do
  [[ -z "$pkg" || "$pkg" == \#* ]] && continue
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done < scripts/apt-packages.txt
if ((${#need[@]})); then
  echo "installing: ${need[*]}"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

# Lints on every crate and target (the core's lint table denies unwrap and unchecked
# indexing; clippy.toml lets test functions use both).
if ! cargo clippy --version >/dev/null 2>&1; then
  rustup component add clippy
fi
cargo clippy --release --workspace --all-targets -- -D warnings

cargo build --release --workspace --bins
# The simulator's tests run once, with the engine's whole-structure audits on (`verify`):
# every checkpoint and every clean close of every seed audits every structure.
cargo test --release --workspace --exclude dedupvol-sim -- --test-threads=2 "$@"
cargo test --release -p dedupvol-sim --features verify -- --test-threads=2 "$@"
# Volumes in Ceph RADOS, against a real one-node cluster (scripts/ceph-cluster.sh; started for
# the tests and stopped again unless it was running already): about two minutes.
if [[ ${DEDUPVOL_SKIP_RADOS:-0} == 1 ]]; then
  echo "SKIPPED: the RADOS tests (DEDUPVOL_SKIP_RADOS=1): run scripts/test-rados.sh to run them"
else
  ./scripts/test-rados.sh target/release/dedupvol
fi
