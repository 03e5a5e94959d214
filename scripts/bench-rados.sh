#!/usr/bin/env bash
# The engine on a volume in RADOS beside the same engine on a local file, in one run,
# rounds interleaved (file, RADOS, file, RADOS, ...): `dedupvol import` of a generated file,
# then over NBD (fio's nbd engine): sequential 1 MiB writes, random 4 KiB writes (both
# ending with an fsync) and random 4 KiB reads. Prints a table of medians and every round.
#
#   scripts/bench-rados.sh [ROUNDS] [DATA SIZE]      (default 3 rounds of 512M)
#
# The cluster is scripts/ceph-cluster.sh's (started if needed); the local file lives beside
# the OSDs' block files (same disk), under $DEDUPVOL_CEPH_DIR/.. .
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${1:-3}
SIZE=${2:-512M}
BIN=$(realpath "${DEDUPVOL_BIN:-target/release/dedupvol}")
export CEPH_CONF=${DEDUPVOL_CEPH_DIR:-/var/tmp/dedupvol-ceph}/ceph.conf
POOL=dedupvol
T=$(mktemp -d /var/tmp/dedupvol-rados-bench.XXXXXX)
PID=""
cleanup() {
  if [[ -n $PID ]]; then kill -9 "$PID" 2>/dev/null && wait "$PID" 2>/dev/null; fi
  rm -rf "$T"
}
trap cleanup EXIT

./scripts/ceph-cluster.sh start >/dev/null
"$BIN" gen --preset write-medium --size "$SIZE" --output "$T/data" >/dev/null

# fio over NBD; prints one number (MB/s for bandwidth jobs, IOPS otherwise).
fio_figure() {
  local uri=$1 what=$2
  shift 2
  (cd "$T" && fio --name=b --ioengine=nbd --uri="$uri" --output-format=json --output="$T/fio.json" "$@" >/dev/null)
  python3 - "$T/fio.json" "$what" <<'EOF'
import json, sys
job = json.load(open(sys.argv[1]))["jobs"][0]
kind, figure = sys.argv[2].split(":")
side = job[kind]
print(f"{side['bw_bytes'] / 1e6:.0f}" if figure == "mbs" else f"{side['iops']:.0f}")
EOF
}

RESULTS=$T/results
: >"$RESULTS"
for ((r = 1; r <= ROUNDS; r++)); do
  for backend in file rados; do
    if [[ $backend == file ]]; then
      VOL=$T/vol-$r.img
      "$BIN" format "$VOL" --logical-size 4G --physical-size 2G >/dev/null
    else
      VOL=rados://$POOL/bench-$$-$r
      "$BIN" format "$VOL" --logical-size 4G --physical-size 2G >/dev/null
    fi
    ingest=$("$BIN" import "$VOL" "$T/data" | sed -n 's/.*(\([0-9.]*\) MB\/s).*/\1/p')
    "$BIN" serve --socket "$T/s.sock" "$VOL" >"$T/serve.log" 2>&1 &
    PID=$!
    for _ in $(seq 300); do grep -q serving "$T/serve.log" && break; sleep 0.1; done
    uri="nbd+unix:///dedupvol?socket=$T/s.sock"
    seqw=$(fio_figure "$uri" write:mbs --rw=write --bs=1m --offset=1g --size=512m --iodepth=8 --end_fsync=1)
    randw=$(fio_figure "$uri" write:iops --rw=randwrite --bs=4k --offset=1g --size=512m --iodepth=16 \
      --time_based --runtime=10 --end_fsync=1 --randrepeat=0)
    randr=$(fio_figure "$uri" read:iops --rw=randread --bs=4k --size=1g --iodepth=16 --time_based --runtime=10)
    kill -TERM "$PID"
    wait "$PID" || true
    PID=""
    echo "$backend $r $ingest $seqw $randw $randr" | tee -a "$RESULTS" >&2
    if [[ $backend == file ]]; then rm -f "$VOL"; fi
  done
done

python3 - "$RESULTS" "$SIZE" <<'EOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
cols = ["import MB/s", "NBD seq write 1M MB/s", "NBD rand write 4K IOPS", "NBD rand read 4K IOPS"]
print(f"data: dedupvol gen --preset write-medium, {sys.argv[2]}; medians of {len(rows) // 2} interleaved rounds")
print("| backend | " + " | ".join(cols) + " |")
print("|---|" + "---:|" * len(cols))
for b in ("file", "rados"):
    mine = [r for r in rows if r[0] == b]
    med = [statistics.median(float(r[i]) for r in mine) for i in range(2, 6)]
    name = "local file" if b == "file" else "RADOS (2 OSDs, size 2)"
    print(f"| {name} | " + " | ".join(f"{m:.0f}" for m in med) + " |")
print()
print("every round (backend round import seqw randw randr):")
for r in rows:
    print("  " + " ".join(r))
EOF
for ((r = 1; r <= ROUNDS; r++)); do
  timeout 120 rados -p "$POOL" ls | grep "^bench-$$-$r" | xargs -r -n 256 timeout 120 rados -p "$POOL" rm || true
done
