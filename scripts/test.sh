#!/usr/bin/env bash
# The project's test command (README.md): installs the real clients the tests drive
# (qemu-img, nbdcopy, nbdinfo, fio, nbdfuse, e2fsck) when missing, then runs every test.
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

cargo build --release --workspace --bins
cargo test --release --workspace -- --test-threads=2 "$@"
