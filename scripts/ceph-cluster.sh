#!/usr/bin/env bash
# A one-node Ceph cluster for the RADOS backend's tests and benchmarks: one monitor, one
# manager and two OSDs (BlueStore on sparse files), run as plain processes (no systemd).
#
#   scripts/ceph-cluster.sh start    # create on first use, (re)start the daemons, wait for I/O
#   scripts/ceph-cluster.sh status   # `ceph -s`
#   scripts/ceph-cluster.sh running  # exit status 0 when the cluster's monitor runs
#   scripts/ceph-cluster.sh stop     # stop the daemons (the data stays; `start` resumes)
#   scripts/ceph-cluster.sh destroy  # stop and delete everything
#   scripts/ceph-cluster.sh stop-osd N / start-osd N   # one OSD (the OSD-loss tests; stop is SIGTERM)
#
# Everything lives under $DEDUPVOL_CEPH_DIR (default /var/tmp/dedupvol-ceph); clients find
# the cluster through $DIR/ceph.conf (export CEPH_CONF=$DIR/ceph.conf). The pool is
# `dedupvol`, replicated twice across the two OSDs (min_size 1: one OSD down keeps it
# writable). One keyring, $DIR/keyring, holds every key: a throw-away local test cluster.
set -euo pipefail

DIR=${DEDUPVOL_CEPH_DIR:-/var/tmp/dedupvol-ceph}
CONF=$DIR/ceph.conf
POOL=dedupvol
OSDS=2
# BlueStore block file per OSD (sparse: only what is written takes space).
OSD_BYTES=${DEDUPVOL_CEPH_OSD_BYTES:-$((8 << 30))}
MON_PORT=${DEDUPVOL_CEPH_MON_PORT:-6789}
START_TIMEOUT=${DEDUPVOL_CEPH_START_TIMEOUT:-120}

ceph_() { timeout 30 ceph -c "$CONF" "$@"; }
# The pid in a daemon's pid file, if that process is still this cluster's daemon. A daemon
# killed with SIGKILL leaves its pid file behind, and pids are reused (pid_max is often
# 32768), so a pid is trusted only when its command line names this cluster's config.
daemon_pid() {
  local pf=$1 pid
  [[ -f "$pf" ]] || return 1
  pid=$(cat "$pf" 2>/dev/null) || return 1
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  { tr '\0' ' ' <"/proc/$pid/cmdline"; } 2>/dev/null | grep -qF -- "-c $CONF" || return 1
  echo "$pid"
}
alive() { daemon_pid "$1" >/dev/null; }
# Stops one daemon: SIGTERM, up to 30 s for a clean exit, then SIGKILL. BlueStore on a
# file has been seen to fail its own checksums at the next start after a SIGKILL, so the
# OSD-loss tests stop OSDs this way too: a stopped OSD is as gone to clients as a dead one.
stop_daemon() {
  local pf=$1 pid
  pid=$(daemon_pid "$pf") || return 0
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  echo "ceph-cluster: $(basename "$pf" .pid) did not stop within 30 s: SIGKILL" >&2
  kill -9 "$pid" 2>/dev/null || true
}
# Starts one daemon (NAME ID); a daemon that fails its start is reported with its log.
start_daemon() {
  local name=$1 id=$2
  if ! "ceph-$name" -c "$CONF" -i "$id" 2>>"$DIR/log/stderr.log"; then
    echo "ceph-cluster: $name.$id failed to start; the end of $DIR/log/$name.$id.log:" >&2
    tail -n 20 "$DIR/log/$name.$id.log" >&2 || true
    return 1
  fi
}

write_conf() {
  local fsid=$1
  cat >"$CONF" <<EOF
[global]
fsid = $fsid
mon host = v1:127.0.0.1:$MON_PORT
mon initial members = a
public network = 127.0.0.0/8
keyring = $DIR/keyring
ms bind ipv6 = false
run dir = $DIR/run
admin socket = $DIR/run/\$name.asok
pid file = $DIR/run/\$name.pid
log file = $DIR/log/\$name.log
crash dir = $DIR/crash
osd pool default size = 2
osd pool default min size = 1
osd pool default pg num = 16
osd pool default pgp num = 16
osd crush chooseleaf type = 0
mon allow pool delete = true
mon warn on pool no redundancy = false
mon osd min down reporters = 1
osd heartbeat grace = 6
osd heartbeat interval = 1
mon osd down out interval = 0
mon data avail warn = 2
mon data avail crit = 1

[mon]
mon data = $DIR/mon.\$id

[mgr]
mgr data = $DIR/mgr.\$id
mgr initial modules =

[osd]
osd data = $DIR/osd.\$id
osd objectstore = bluestore
bluestore block create = true
bluestore block size = $OSD_BYTES
bluestore fsck on mkfs = false
osd memory target = 1073741824
bluestore cache autotune = false
bluestore cache size = 268435456
osd op num shards = 2
osd op num threads per shard = 1
EOF
}

stop_all() {
  for name in osd.1 osd.0 mgr.x mon.a; do stop_daemon "$DIR/run/$name.pid"; done
}

create() {
  stop_all
  rm -rf "$DIR"
  mkdir -p "$DIR"/{run,log,crash}
  local fsid
  fsid=$(cat /proc/sys/kernel/random/uuid)
  write_conf "$fsid"
  monmaptool --create --add a "127.0.0.1:$MON_PORT" --fsid "$fsid" "$DIR/monmap" >/dev/null
  ceph-authtool --create-keyring "$DIR/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
  ceph-authtool "$DIR/keyring" --gen-key -n client.admin \
    --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' --cap mds 'allow *' >/dev/null
  ceph-mon -c "$CONF" --mkfs -i a --monmap "$DIR/monmap" --keyring "$DIR/keyring"
  start_daemon mon a
  mkdir -p "$DIR/mgr.x"
  ceph_ auth get-or-create mgr.x mon 'allow profile mgr' osd 'allow *' mds 'allow *' >>"$DIR/keyring"
  start_daemon mgr x
  for ((i = 0; i < OSDS; i++)); do
    local uuid id
    uuid=$(cat /proc/sys/kernel/random/uuid)
    id=$(ceph_ osd new "$uuid")
    mkdir -p "$DIR/osd.$id"
    ceph_ auth get-or-create "osd.$id" mon 'allow profile osd' mgr 'allow profile osd' osd 'allow *' >>"$DIR/keyring"
    ceph-osd -c "$CONF" -i "$id" --mkfs --osd-uuid "$uuid" 2>>"$DIR/log/mkfs.log"
    start_daemon osd "$id"
  done
  ceph_ osd pool create "$POOL" 16 16 replicated >/dev/null 2>&1
  ceph_ osd pool application enable "$POOL" dedupvol >/dev/null 2>&1
}

start_daemons() {
  alive "$DIR/run/mon.a.pid" || start_daemon mon a
  alive "$DIR/run/mgr.x.pid" || start_daemon mgr x
  for ((i = 0; i < OSDS; i++)); do
    alive "$DIR/run/osd.$i.pid" || start_daemon osd "$i"
  done
}

# Waits until an object can be written and read back in the pool (every PG it needs is
# active), so the caller's first I/O does not stall on peering.
wait_ready() {
  local deadline=$((SECONDS + START_TIMEOUT))
  until ceph_ osd pool ls 2>/dev/null | grep -qx "$POOL"; do
    ((SECONDS < deadline)) || { echo "ceph-cluster: pool $POOL never appeared" >&2; return 1; }
    ceph_ osd pool create "$POOL" 16 16 replicated >/dev/null 2>&1 || sleep 1
  done
  until [[ $(ceph_ osd stat -f json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["num_up_osds"])' 2>/dev/null) == "$OSDS" ]]; do
    ((SECONDS < deadline)) || { echo "ceph-cluster: OSDs not up after ${START_TIMEOUT}s (see $DIR/log)" >&2; return 1; }
    sleep 1
  done
  for ((k = 0; k < 16; k++)); do
    until timeout 10 rados -c "$CONF" -p "$POOL" put "ready.$k" "$CONF" 2>/dev/null; do
      ((SECONDS < deadline)) || { echo "ceph-cluster: pool $POOL not writable after ${START_TIMEOUT}s" >&2; return 1; }
      sleep 1
    done
    timeout 10 rados -c "$CONF" -p "$POOL" rm "ready.$k" 2>/dev/null || true
  done
}

case ${1:-} in
  start)
    t0=$SECONDS
    if [[ -f "$DIR/osd.$((OSDS - 1))/ready" && -f "$CONF" ]]; then
      start_daemons
    else
      create
    fi
    wait_ready
    echo "ceph-cluster: ready in $((SECONDS - t0)) s: pool $POOL, CEPH_CONF=$CONF"
    ;;
  running)
    # Exit status 0 when this cluster's monitor runs.
    alive "$DIR/run/mon.a.pid"
    ;;
  stop)
    stop_all
    echo "ceph-cluster: stopped"
    ;;
  destroy)
    "$0" stop
    rm -rf "$DIR"
    ;;
  status)
    ceph_ -s
    ;;
  stop-osd)
    stop_daemon "$DIR/run/osd.${2:?OSD id}.pid"
    ;;
  start-osd)
    alive "$DIR/run/osd.${2:?OSD id}.pid" || start_daemon osd "$2"
    ;;
  *)
    echo "usage: $0 start|stop|status|running|destroy|stop-osd N|start-osd N" >&2
    exit 2
    ;;
esac
