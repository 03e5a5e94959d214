#!/usr/bin/env bash
# The main job, end to end (README.md): build dedupvol, format a thin-provisioned volume,
# import real data (a tar of this machine's /usr/share and /usr/lib, twice, the second
# copy at another offset — the way VM images repeat an OS), show the reduction and the
# I/O breakdown, audit the volume, then serve it over NBD until Ctrl-C.
#   ./scripts/demo.sh            # everything, then serve on 127.0.0.1:10809
#   ./scripts/demo.sh --no-serve # stop after the audit
set -euo pipefail
cd "$(dirname "$0")/.."
serve=1
[[ "${1:-}" == "--no-serve" ]] && serve=0
work=${DEDUPVOL_DEMO_DIR:-/tmp/dedupvol-demo}
mkdir -p "$work"

# Building needs a C compiler and make (zstd and jemalloc are built from C sources).
if ! command -v make >/dev/null || ! command -v cc >/dev/null; then
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq make gcc >/dev/null
fi
cargo build --release -p dedupvol-cli
bin=target/release/dedupvol

echo "== preparing real data: tar of /usr/share and /usr/lib (capped at 1 GiB)"
tar -cf - /usr/share /usr/lib 2>/dev/null | head -c $((1 << 30)) > "$work/usr.tar" || true
size=$(stat -c %s "$work/usr.tar")
echo "   $((size >> 20)) MiB"

echo "== formatting $work/vol.img: 8 GiB logical on a 2 GiB file"
$bin format "$work/vol.img" --logical-size 8G --physical-size 2G --force

echo "== importing the tar twice (second copy at 4 GiB: all duplicates), then settling"
echo "   (writes compress with zstd 1; the volume then compresses its data at rest once more"
echo "   with zstd 6, as a served volume does by itself while idle)"
$bin import "$work/vol.img" "$work/usr.tar"
$bin import "$work/vol.img" "$work/usr.tar" --offset 4G --settle

echo "== stats"
$bin stats "$work/vol.img"
echo "== audit"
$bin check "$work/vol.img"

echo "== export and compare the second copy"
$bin export "$work/vol.img" "$work/export.img"
cmp -n "$size" "$work/usr.tar" "$work/export.img" && echo "   first copy identical"
cmp -n "$size" -i $((4 << 30)):0 "$work/export.img" "$work/usr.tar" && echo "   second copy identical"
rm -f "$work/export.img"

if ((serve)); then
  echo "== serving over NBD (Ctrl-C stops it cleanly). Try: nbdinfo nbd://127.0.0.1:10809/dedupvol"
  exec $bin serve "$work/vol.img"
fi
