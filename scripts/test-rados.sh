#!/usr/bin/env bash
# Volumes in Ceph RADOS, against a real one-node cluster (scripts/ceph-cluster.sh):
#   1. format / import / export / check of rados://dedupvol/NAME, bytes compared;
#   2. fio over NBD (crc32c verified) with the volume in RADOS;
#   3. one writer: a second server is refused while the first serves; kill -9 of the
#      server mid-write, take-over by a second process (--take-over), every byte flushed
#      before the kill read back; a live holder taken over is fenced (its writes fail);
#   4. an OSD stopped mid-run, then both for a while: the writes wait, finish, verify, and
#      the volume checks clean; with an operation timeout (CEPH_ARGS) and every OSD down,
#      writes fail with an error, and the volume still checks clean and verifies.
# Usage: scripts/test-rados.sh [path to the dedupvol binary]   (default target/release)
# Fails (non-zero) when the cluster cannot start: nothing here is skipped silently.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=$(realpath "${1:-target/release/dedupvol}")
CLUSTER=./scripts/ceph-cluster.sh
# A cluster already running under $DEDUPVOL_CEPH_DIR (default /var/tmp/dedupvol-ceph) is
# used and left running. Otherwise the tests make a new cluster in a directory of their
# own (about 15 s) and delete it at the end: a cluster left behind by an earlier run, its
# daemons killed with it, is never trusted (nor touched).
WAS_RUNNING=0
if $CLUSTER running; then
  WAS_RUNNING=1
else
  export DEDUPVOL_CEPH_DIR
  DEDUPVOL_CEPH_DIR=$(mktemp -d /var/tmp/dedupvol-ceph-test.XXXXXX)
fi
CEPH_DIR=${DEDUPVOL_CEPH_DIR:-/var/tmp/dedupvol-ceph}
export CEPH_CONF=$CEPH_DIR/ceph.conf
POOL=dedupvol
RUN=t$$-$(date +%s)
T=$(mktemp -d /var/tmp/dedupvol-rados-test.XXXXXX)
SERVERS=()

cleanup() {
  # Nothing here may end the cleanup early: a killed server's `wait` returns 137, which
  # under `set -e` would exit with it and leave the cluster running.
  set +e
  # Only servers still running as this script's children: an exited one's pid may be reused.
  for pid in "${SERVERS[@]}"; do
    if [[ $(ps -o ppid= -p "$pid" 2>/dev/null | tr -d ' ') == "$$" ]]; then
      kill -9 "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    fi
  done
  rm -rf "$T"
  if ((WAS_RUNNING)); then
    # Leave both OSDs running for the cluster's other users.
    $CLUSTER start-osd 0 >/dev/null 2>&1 || true
    $CLUSTER start-osd 1 >/dev/null 2>&1 || true
  else
    $CLUSTER destroy >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT

step() { echo "test-rados: $*"; }
fail() { echo "test-rados: FAILED: $*" >&2; exit 1; }

# Starts `dedupvol serve` on a Unix socket in the background; sets SERVER_PID once it
# prints that it serves (or fails when it exits first).
serve() {
  local sock=$1 log=$2
  shift 2
  "$BIN" serve --socket "$sock" "$@" >"$log" 2>&1 &
  SERVER_PID=$!
  SERVERS+=("$SERVER_PID")
  for _ in $(seq 600); do
    grep -q "serving" "$log" && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || { cat "$log" >&2; return 1; }
    sleep 0.1
  done
  cat "$log" >&2
  fail "server did not start within 60 s"
}
uri() { echo "nbd+unix:///dedupvol?socket=$1"; }
# `dedupvol check VOLUME` must say "clean"; its output is shown when it does not.
check_clean() {
  local out
  out=$("$BIN" check "$1" 2>&1) || true
  [[ $(tail -1 <<<"$out") == clean ]] || { echo "$out" >&2; fail "$2"; }
}

fio_job() {
  local uri=$1 offset=$2 extra=$3
  # shellcheck disable=SC2086
  (cd "$T" && timeout 600 fio --name=rados --ioengine=nbd --uri="$uri" --rw=randwrite --bs=4k --size=16m \
    --offset="$offset" --iodepth=16 --verify=crc32c --verify_fatal=1 --dedupe_percentage=50 \
    --buffer_compress_percentage=50 --randseed=7 --end_fsync=1 $extra)
}

t0=$SECONDS
$CLUSTER start || fail "the Ceph cluster did not start (logs under ${CEPH_CONF%/*}/log)"

# Data: 24 MiB random, written twice (dedup) and a compressible 8 MiB.
head -c $((24 << 20)) /dev/urandom >"$T/r"
{ cat "$T/r" "$T/r"; { yes dedupvol-rados || true; } | head -c $((8 << 20)); } >"$T/in"

step "1. format, import, export, check on rados://$POOL/$RUN-a"
VOL=rados://$POOL/$RUN-a
"$BIN" format "$VOL" --logical-size 256M --physical-size 128M >/dev/null
"$BIN" import "$VOL" "$T/in"
"$BIN" export "$VOL" "$T/out"
cmp -n "$(stat -c %s "$T/in")" "$T/in" "$T/out" || fail "exported bytes differ from the imported ones"
SIZE=$(stat -c %s "$T/in")
cmp -i "$SIZE:0" -n $(((256 << 20) - SIZE)) "$T/out" /dev/zero || fail "the unwritten tail does not read as zeroes"
check_clean "$VOL" "check of $VOL is not clean"
"$BIN" format "$VOL" --logical-size 256M --physical-size 256M 2>"$T/err" && fail "a RADOS device was resized"
grep -q "keeps its size" "$T/err" || fail "resize refusal unclear: $(cat "$T/err")"

step "1b. the metadata on its own RADOS device"
VOL=rados://$POOL/$RUN-m
"$BIN" format "$VOL" --logical-size 256M --physical-size 128M --meta-device "rados://$POOL/$RUN-mm" --meta-size 32M >/dev/null
"$BIN" info "$VOL" | grep -q "$RUN-mm" || fail "the volume does not record its metadata device"
"$BIN" import "$VOL" "$T/in"
"$BIN" export "$VOL" "$T/out"
cmp -n "$SIZE" "$T/in" "$T/out" || fail "exported bytes differ (metadata in RADOS)"
check_clean "$VOL" "check of $VOL is not clean"

step "2. fio over NBD, data in RADOS"
VOL=rados://$POOL/$RUN-b
"$BIN" format "$VOL" --logical-size 256M --physical-size 128M >/dev/null
serve "$T/b.sock" "$T/b.log" "$VOL"
fio_job "$(uri "$T/b.sock")" 0 "--numjobs=2 --offset_increment=16m --group_reporting" >"$T/fio-b.txt" ||
  { cat "$T/fio-b.txt" >&2; fail "fio over NBD"; }

step "3a. a second writer is refused while the first serves"
"$BIN" serve --socket "$T/b2.sock" "$VOL" >"$T/b2.log" 2>&1 && fail "a second server opened a held volume"
grep -q "open elsewhere" "$T/b2.log" || fail "second server's refusal unclear: $(cat "$T/b2.log")"

step "3b. kill -9 mid-write, take-over, flushed data intact"
nbdcopy --flush "$T/in" "$(uri "$T/b.sock")" || fail "nbdcopy into the first server"
# Unflushed writes elsewhere, in flight when the server dies.
(cd "$T" && timeout 120 fio --name=inflight --ioengine=nbd --uri="$(uri "$T/b.sock")" --rw=randwrite --bs=64k \
  --offset=128m --size=64m --iodepth=16 --time_based --runtime=60 >/dev/null 2>&1) &
FIO=$!
sleep 3
{ kill -9 "$SERVER_PID" && wait "$SERVER_PID"; } 2>/dev/null || true
wait "$FIO" 2>/dev/null || true
"$BIN" serve --socket "$T/c.sock" "$VOL" >"$T/c0.log" 2>&1 && fail "a dead server's lock was ignored without --take-over"
grep -q "take the volume over" "$T/c0.log" || fail "refusal after the crash unclear: $(cat "$T/c0.log")"
serve "$T/c.sock" "$T/c.log" --take-over "$VOL"
nbdcopy "$(uri "$T/c.sock")" "$T/c.out"
cmp -n "$(stat -c %s "$T/in")" "$T/in" "$T/c.out" || fail "data flushed before the kill -9 differs after the take-over"
TAKER=$SERVER_PID

step "3c. taking over from a live server fences it"
serve "$T/d.sock" "$T/d.log" --take-over "$VOL"
{ yes fenced || true; } | head -c $((4 << 20)) >"$T/fenced"
if nbdcopy --flush "$T/fenced" "$(uri "$T/c.sock")" 2>"$T/fenced.err"; then
  fail "the fenced server acknowledged a flush after it was taken over"
fi
step "   the fenced server's client saw: $(tail -1 "$T/fenced.err")"
{ kill -9 "$TAKER" && wait "$TAKER"; } 2>/dev/null || true
nbdcopy "$(uri "$T/d.sock")" "$T/d.out"
cmp -n "$(stat -c %s "$T/in")" "$T/in" "$T/d.out" || fail "data changed by the fenced server"
kill -TERM "$SERVER_PID"
wait "$SERVER_PID" || fail "the taking-over server did not stop cleanly"
check_clean "$VOL" "check after the take-overs is not clean"

# Serves $VOL as TAG (more serve options after the message) and verifies step 4's fio
# data over NBD (message: what failed).
verify_step4() {
  local tag=$1 what=$2
  serve "$T/$tag.sock" "$T/$tag.log" "${@:3}" "$VOL"
  fio_job "$(uri "$T/$tag.sock")" 0 "--numjobs=2 --offset_increment=16m --group_reporting --verify_only=1" \
    >"$T/fio-$tag.txt" || { cat "$T/fio-$tag.txt" >&2; fail "$what"; }
  kill -TERM "$SERVER_PID"
  wait "$SERVER_PID" || true
}

step "4. OSDs stopped mid-run: writes wait, finish and verify"
VOL=rados://$POOL/$RUN-c
"$BIN" format "$VOL" --logical-size 256M --physical-size 128M >/dev/null
serve "$T/e.sock" "$T/e.log" "$VOL"
fio_job "$(uri "$T/e.sock")" 0 "--numjobs=2 --offset_increment=16m --group_reporting --rate=1m" >"$T/fio-e.txt" 2>&1 &
FIO=$!
# fio's writes take about 16 s; its closing fsync can only return once RADOS has them.
# An OSD stop (SIGTERM, clean exit) takes about 2 s.
sleep 1
$CLUSTER stop-osd 1
sleep 1
$CLUSTER stop-osd 0
step "   both OSDs down for 10 s"
sleep 10
kill -0 "$FIO" 2>/dev/null || { cat "$T/fio-e.txt" >&2; fail "fio's fsync returned while every OSD was down"; }
$CLUSTER start-osd 0
$CLUSTER start-osd 1
wait "$FIO" || { cat "$T/fio-e.txt" >&2; fail "fio across the OSD stops"; }
kill -TERM "$SERVER_PID"
wait "$SERVER_PID" || fail "the server did not stop cleanly after the OSD stops"
check_clean "$VOL" "check after the OSD stops is not clean"
verify_step4 f "fio verify after the OSD stops"

step "4b. every OSD down with an operation timeout: writes fail cleanly, nothing is damaged"
CEPH_ARGS="--rados-osd-op-timeout 5" serve "$T/g.sock" "$T/g.log" "$VOL"
$CLUSTER stop-osd 0
$CLUSTER stop-osd 1
# Unique data (--refill_buffers), so the engine must hand blocks to the data device while
# the writes run. fio's nbd engine does not report a failed closing flush (seen with fio
# 3.33: "err=0" while the server answered the flush with EIO), so the server's log is the
# witness when every write was accepted into memory before the failure surfaced.
# `-k`: fio ignores SIGTERM while a request is unanswered.
rc=0
(cd "$T" && timeout -k 10 120 fio --name=down --ioengine=nbd --uri="$(uri "$T/g.sock")" --rw=write --bs=64k \
  --offset=64m --size=16m --iodepth=4 --refill_buffers --end_fsync=1 >"$T/fio-g.txt" 2>&1) || rc=$?
if [ "$rc" = 0 ]; then
  grep -q "failed: flush" "$T/g.log" || fail "writes and their flush succeeded with every OSD down"
  step "   fio's writes were accepted; the server failed the flush: $(grep -m1 -o 'failed: flush.*' "$T/g.log")"
elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
  # Every wait for the cluster ends within about twice the operation timeout, and a
  # background pass whose block-map scan cannot read a page ends there (it once asked
  # again for each entry of the page, one timeout each, under the state lock).
  fail "the server stopped answering with every OSD down (fio killed after 120 s)"
else
  step "   fio saw: $(grep -m1 -io 'error.*' "$T/fio-g.txt" || echo "a failure")"
fi
# Back and writable before the server stops: its unlock at close is subject to the same
# timeout (a server that exits while the cluster is away leaves its lock, to be taken over).
$CLUSTER start >/dev/null
kill -TERM "$SERVER_PID"
wait "$SERVER_PID" || true
grep -q "open elsewhere" <("$BIN" info "$VOL" 2>&1) && step "   the failed server left its lock behind"
# The failed server may leave its lock (its unlock can time out too): the next server
# takes the volume over, as after any server loss, and replays the journal.
verify_step4 h "data written before the failed writes does not verify" --take-over
check_clean "$VOL" "check after the failed writes is not clean"

for n in a b c m; do
  timeout 60 rados -p "$POOL" ls | grep "^$RUN-$n" | xargs -r -n 64 timeout 60 rados -p "$POOL" rm || true
done
step "all passed in $((SECONDS - t0)) s"
