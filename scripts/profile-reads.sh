#!/usr/bin/env bash
# Where a dedupvol server spends its CPU on large sequential reads, next to nbdkit's
# bandwidth on the same bytes.
#
#   scripts/profile-reads.sh BIN [WORKDIR]
#
# Fills a fresh volume with SIZE (default 1536M) of 90%-reducible data, serves it on a Unix
# socket and runs fio (ioengine=nbd, rw=read, bs=1M, iodepth=16, RUNTIME s, default 15)
# while `perf record -g` samples the server. Prints the top 25 symbols by self time and
# fio's bandwidth, then the same fio job against `nbdkit file` on a raw file of the same
# bytes (exported from the volume).
#
# FILL chooses how the data gets in:
#   fio     (default) fio writes through the same server just before the reads (90% of the
#           1 MiB buffers repeat an earlier one, the rest 50% compressible), so the reads
#           see a session that has just written, as a client reading back its writes does;
#   import  `dedupvol gen --dup 90 --compress 50` imported offline, then a fresh server.
#
# WORKDIR (default: a fresh directory under /var/tmp) holds the volume, the raw file and
# perf.data; it is removed on exit unless KEEP=1.
# Needs fio with its nbd engine (libnbd), nbdkit and perf.
set -euo pipefail

usage() { echo "usage: $0 BIN [WORKDIR]   (env: SIZE=1536M RUNTIME=15 KEEP=0)" >&2; exit 2; }
(($# >= 1 && $# <= 2)) || usage
bin=$(realpath "$1")
[[ -x "$bin" ]] || { echo "profile-reads: $bin is not an executable" >&2; exit 2; }
size=${SIZE:-1536M}
runtime=${RUNTIME:-15}
keep=${KEEP:-0}
fill=${FILL:-fio}
[[ "$fill" == fio || "$fill" == import ]] || { echo "profile-reads: FILL must be fio or import, not '$fill'" >&2; exit 2; }
for tool in fio nbdkit perf; do
  command -v "$tool" >/dev/null || { echo "profile-reads: $tool is not installed" >&2; exit 1; }
done
fio --enghelp=nbd >/dev/null 2>&1 || { echo "profile-reads: this fio has no nbd engine" >&2; exit 1; }

if (($# == 2)); then
  work=$(realpath -m "$2"); mkdir -p "$work"
else
  work=$(mktemp -d /var/tmp/profile-reads.XXXXXX)
fi
avail_kib=$(df -Pk "$work" | awk 'NR==2 {print $4}')
if ((avail_kib < 5 * 1024 * 1024)); then
  echo "profile-reads: only $((avail_kib / 1024)) MiB free under $work; about 5 GiB needed" >&2
  exit 1
fi

# Every process this script starts is recorded here and stopped on exit, by its pid.
pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do
    if kill -0 "$p" 2>/dev/null; then
      kill -TERM "$p" 2>/dev/null || true
      # The server closes its volume cleanly on SIGTERM; give it a moment, then insist.
      for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
      kill -KILL "$p" 2>/dev/null || true
    fi
  done
  if [[ "$keep" == 1 ]]; then
    echo "profile-reads: kept $work" >&2
  else
    rm -rf "$work"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

raw="$work/data.raw"
vol="$work/vol.img"
sock="$work/dedupvol.sock"
ksock="$work/nbdkit.sock"

# Waits up to 30 s for the file $1 to contain the pattern $2 while process $3 lives.
wait_for() {
  local file=$1 pattern=$2 pid=$3
  for _ in $(seq 300); do
    grep -q "$pattern" "$file" 2>/dev/null && return 0
    kill -0 "$pid" 2>/dev/null || { echo "profile-reads: process $pid exited; its output:" >&2; cat "$file" >&2; return 1; }
    sleep 0.1
  done
  echo "profile-reads: timed out waiting for '$pattern' in $file" >&2
  return 1
}

# One fio job, the same for both servers: prints fio's read summary line.
run_fio() {
  local uri=$1 name=$2
  fio --name="$name" --ioengine=nbd --uri="$uri" --rw=read --bs=1M --iodepth=16 \
    --size="$size" --time_based --runtime="$runtime" --output="$work/fio-$name.txt"
  grep -E '^ *READ: bw=' "$work/fio-$name.txt" | sed 's/^ *//'
}

echo "== profile-reads: $bin ($(sha256sum "$bin" | cut -c1-16)), $(date -u +%FT%TZ)"
echo "fill: $fill, $size of 90%-reducible data; fio rw=read bs=1M iodepth=16 ${runtime}s"
"$bin" format "$vol" --logical-size "$size" --physical-size 2G --force >"$work/format.txt"
if [[ "$fill" == import ]]; then
  "$bin" gen --dup 90 --compress 50 --size "$size" --output "$raw" >"$work/gen.txt"
  "$bin" import "$vol" "$raw" >"$work/import.txt"
  rm -f "$raw"  # nbdkit gets the volume's export below, as in the fio fill
fi

echo
echo "== dedupvol serve (default settings), perf record -g on the server during the reads"
"$bin" serve "$vol" --socket "$sock" >"$work/serve.out" 2>"$work/serve.err" &
server=$!; pids+=("$server")
wait_for "$work/serve.out" "serving" "$server"
if [[ "$fill" == fio ]]; then
  fio --name=fill --ioengine=nbd --uri="nbd+unix:///?socket=$sock" --rw=write --bs=1M --iodepth=16 \
    --size="$size" --dedupe_percentage=90 --buffer_compress_percentage=50 --buffer_compress_chunk=4096 \
    --refill_buffers --output="$work/fio-fill.txt"
  echo "fill: $(grep -E '^ *WRITE: bw=' "$work/fio-fill.txt" | sed 's/^ *//')"
fi
perf record -q -g -p "$server" -o "$work/perf.data" >"$work/perf-record.txt" 2>&1 &
perf_pid=$!; pids+=("$perf_pid")
sleep 0.5
run_fio "nbd+unix:///?socket=$sock" dedupvol
kill -INT "$perf_pid"
wait "$perf_pid" || true
kill -TERM "$server"
wait "$server" || { echo "profile-reads: server exited with status $?; stderr:" >&2; cat "$work/serve.err" >&2; }
"$bin" stats "$vol" | grep -E '^(logical in use|physical data used|reduction ratio|savings)' || true

echo
echo "== perf report --no-children --sort symbol (top 25, server process)"
# awk, not head: head would stop reading early and pipefail would end the script (SIGPIPE).
perf report -i "$work/perf.data" --no-children --sort symbol --stdio -g none 2>/dev/null \
  | grep -vE '^#|^$' | sed -E 's/[[:space:]]+-[[:space:]]+-[[:space:]]*$//' | awk 'NR <= 25'
echo "decode_unwritten: $(perf report -i "$work/perf.data" --no-children --sort symbol --stdio -g none 2>/dev/null \
  | awk '/decode_unwritten/ {print $1; found = 1} END {if (!found) print "not sampled"}')"

echo
echo "== nbdkit file (the same bytes: the volume exported to a raw file, in the page cache)"
"$bin" export "$vol" "$raw" >"$work/export.txt"
nbdkit --foreground --read-only --unix "$ksock" file "$raw" >"$work/nbdkit.out" 2>&1 &
kpid=$!; pids+=("$kpid")
for _ in $(seq 100); do [[ -S "$ksock" ]] && break; sleep 0.1; done
[[ -S "$ksock" ]] || { echo "profile-reads: nbdkit did not start:" >&2; cat "$work/nbdkit.out" >&2; exit 1; }
cat "$raw" >/dev/null  # warm the page cache, as dedupvol's content cache is warm after its first pass
run_fio "nbd+unix:///?socket=$ksock" nbdkit
