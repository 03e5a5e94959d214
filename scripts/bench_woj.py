#!/usr/bin/env python3
"""Write-once journaling benchmark: ext4 mounted with data=journal on a served volume.

For each configuration (dedup off / on, WOJ off / auto) a fresh volume is formatted
(compression none by default, so that blocks stored are blocks written; --compression
zstd for the engine's default), served, exposed as a file by
nbdfuse, made ext4 and loop-mounted with data=journal. Each workload runs on a fresh mount
and ends with umount, which checkpoints the journal; the server's own counters (through
`dedupvol stats --json`, the admin socket) are read before and after:

  logical   blocks the file system wrote (journal, checkpoints and metadata) x 4 KiB
  device    data bytes written to the data device
  saved     1 - device / logical (none: zero blocks only)
  MB/s      bytes the application wrote / wall time of the workload (fsyncs included)
  CPU s/GB  the server process's user+system CPU per GB of logical writes
  memory    the WOJ pool's bytes, and the fingerprint index's table when dedup is on

Workloads: 4 KiB sequential writes to a new file and 4 KiB random overwrites of an
existing file, with an fsync every 10 / 100 / 1000 writes (sizes scaled down from the
paper's 8 GiB file, see --seq-mib / --rand-writes); a copy of a real tree (cp -a); a
SQLite insert load (python3 sqlite3, rollback journal, one transaction per batch).
Data is random (os.urandom): the only duplicates are the file system's own journal copies.

Run as root (mount). Usage: scripts/bench-woj.sh [--quick] [--configs none,blake3,woj,both]
"""

import argparse
import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {
    # name: (format --dedup, serve --woj)
    "none": ("off", "off"),
    "blake3": ("on", "off"),
    "woj": ("off", "auto"),
    "both": ("on", "auto"),
}


def sh(*args, **kw):
    return subprocess.run(list(args), check=True, **kw)


class Served:
    """A formatted, served, nbdfuse-exposed, ext4-formatted volume."""

    def __init__(self, exe, work, name, dedup, woj, size, port, connect_port=None, compression="none"):
        self.exe, self.work, self.name = exe, work, name
        self.dir = os.path.join(work, name)
        os.makedirs(self.dir)
        self.vol = os.path.join(self.dir, "vol.img")
        self.fuse = os.path.join(self.dir, "fuse")
        self.mnt = os.path.join(self.dir, "mnt")
        os.makedirs(self.fuse)
        os.makedirs(self.mnt)
        self.env = dict(os.environ, DEDUPVOL_RUNTIME_DIR=os.path.join(self.dir, "run"))
        sh(exe, "format", self.vol, "--logical-size", size, "--physical-size", size, "--dedup", dedup,
           "--compression", compression, "--force", stdout=subprocess.DEVNULL, env=self.env)
        self.log = open(os.path.join(self.dir, "serve.log"), "w+")
        self.server = subprocess.Popen(
            [exe, "serve", self.vol, "--listen", f"127.0.0.1:{port}", "--woj", woj, "--cache-size", "512M"],
            stderr=self.log, stdout=self.log, env=self.env)
        self._wait_line("serving")
        pidfile = os.path.join(self.dir, "nbdfuse.pid")
        self.nbdfuse = subprocess.Popen(["nbdfuse", "-P", pidfile, self.fuse,
                                         f"nbd://127.0.0.1:{connect_port or port}/dedupvol"])
        self._wait(lambda: os.path.exists(pidfile) and os.path.getsize(pidfile) > 0, "nbdfuse")
        self.disk = os.path.join(self.fuse, "nbd")
        sh("mkfs.ext4", "-q", "-F", self.disk)

    def _wait_line(self, word):
        def ready():
            self.log.seek(0)
            if self.server.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read()}")
            return word in self.log.read()
        self._wait(ready, "server")

    def _wait(self, cond, what, secs=60):
        end = time.time() + secs
        while time.time() < end:
            if cond():
                return
            time.sleep(0.05)
        raise RuntimeError(f"{what} not ready after {secs} s")

    def mount(self):
        sh("mount", "-o", "loop,data=journal", self.disk, self.mnt)

    def umount(self):
        sh("umount", self.mnt)

    def stats(self):
        out = subprocess.run([self.exe, "stats", self.vol, "--json"], check=True, capture_output=True,
                             env=self.env).stdout
        return json.loads(out)

    def cpu_seconds(self):
        with open(f"/proc/{self.server.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self):
        subprocess.run(["umount", self.mnt], stderr=subprocess.DEVNULL)
        subprocess.run(["fusermount3", "-u", self.fuse], stderr=subprocess.DEVNULL)
        try:
            self.nbdfuse.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.nbdfuse.kill()
        self.server.terminate()
        try:
            self.server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.server.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def w_seq(mnt, mib, every):
    fd = os.open(os.path.join(mnt, f"seq{every}"), os.O_CREAT | os.O_WRONLY, 0o644)
    n = mib * 256
    for i in range(n):
        os.pwrite(fd, os.urandom(4096), i * 4096)
        if (i + 1) % every == 0:
            os.fsync(fd)
    os.fsync(fd)
    os.close(fd)
    return n * 4096


def w_rand(mnt, writes, every, file_blocks, seed):
    rng = random.Random(seed)
    fd = os.open(os.path.join(mnt, "randfile"), os.O_WRONLY)
    for i in range(writes):
        os.pwrite(fd, os.urandom(4096), rng.randrange(file_blocks) * 4096)
        if (i + 1) % every == 0:
            os.fsync(fd)
    os.fsync(fd)
    os.close(fd)
    return writes * 4096


def w_tree(mnt, tree):
    dst = os.path.join(mnt, "tree")
    sh("cp", "-a", tree, dst)
    sh("sync")
    out = subprocess.run(["du", "-sb", dst], check=True, capture_output=True, text=True).stdout
    return int(out.split()[0])


def w_sqlite(mnt, txns, rows):
    db = sqlite3.connect(os.path.join(mnt, "bench.db"))
    db.execute("create table t (id integer primary key, k blob, v blob)")
    db.commit()
    rng = random.Random(7)
    payload = 0
    for t in range(txns):
        batch = [(os.urandom(16), os.urandom(rng.randrange(100, 400))) for _ in range(rows)]
        payload += sum(len(k) + len(v) for k, v in batch)
        db.executemany("insert into t (k, v) values (?, ?)", batch)
        db.commit()
    db.close()
    return payload


def measure(srv, label, fn):
    srv.mount()
    s0, c0, t0 = srv.stats(), srv.cpu_seconds(), time.time()
    app_bytes = fn()
    t1 = time.time()
    srv.umount()  # checkpoints the journal: the checkpoint writes belong to this workload
    s1, c1 = srv.stats(), srv.cpu_seconds()
    logical = (s1["counters"]["blocks_written"] - s0["counters"]["blocks_written"]) * 4096
    device = s1["io"]["data_write"]["bytes"] - s0["io"]["data_write"]["bytes"]
    w0, w1 = s0.get("woj") or {}, s1.get("woj") or {}
    return {
        "workload": label,
        "app_bytes": app_bytes,
        "secs": t1 - t0,
        "logical": logical,
        "device": device,
        "cpu": c1 - c0,
        "woj_hits": w1.get("hits", 0) - w0.get("hits", 0),
        "woj_collisions": w1.get("collisions", 0) - w0.get("collisions", 0),
        "woj_stale": w1.get("stale", 0) - w0.get("stale", 0),
        "woj_by_read": w1.get("confirmed_by_read", 0) - w0.get("confirmed_by_read", 0),
        "jbd2_blocks": w1.get("journal_meta_blocks", 0) - w0.get("journal_meta_blocks", 0),
        "dedup_hits": s1["counters"]["dedup_hits"] - s0["counters"]["dedup_hits"],
        "pool_bytes": w1.get("pool_bytes", 0),
        "journal_blocks": w1.get("journal_blocks", 0),
        "index_bytes": s1["index_memory_bytes"] if s1["dedup"] else 0,
        "ranges": w1.get("ranges", []),
    }


def run_config(exe, work, name, args, port):
    dedup, woj = CONFIGS[name]
    srv = Served(exe, work, name, dedup, woj, args.size, port, compression=args.compression)
    rows = []
    try:
        for every in args.every:
            rows.append(measure(srv, f"seq 4K fsync/{every}", lambda e=every: w_seq(srv.mnt, args.seq_mib, e)))
        # The random workloads overwrite a file made (and checkpointed) first, unmeasured.
        file_blocks = args.rand_file_mib * 256
        srv.mount()
        fd = os.open(os.path.join(srv.mnt, "randfile"), os.O_CREAT | os.O_WRONLY, 0o644)
        for i in range(0, file_blocks, 256):
            os.pwrite(fd, os.urandom(1 << 20), i * 4096)
        os.fsync(fd)
        os.close(fd)
        srv.umount()
        for every in args.every:
            rows.append(measure(srv, f"rand 4K fsync/{every}",
                                lambda e=every: w_rand(srv.mnt, args.rand_writes, e, file_blocks, e)))
        if args.tree:
            rows.append(measure(srv, f"cp -a {args.tree}", lambda: w_tree(srv.mnt, args.tree)))
        if args.sqlite_txns:
            rows.append(measure(srv, f"sqlite {args.sqlite_txns}x{args.sqlite_rows} inserts",
                                lambda: w_sqlite(srv.mnt, args.sqlite_txns, args.sqlite_rows)))
    finally:
        srv.close()
    return rows


def table(results, configs):
    workloads = [r["workload"] for r in results[configs[0]]]
    print("\n### Data written: device data bytes / logical bytes the file system wrote (saved = 1 - ratio)\n")
    print("| workload | " + " | ".join(f"{c}: logical MiB | {c}: device MiB | {c}: saved" for c in configs) + " |")
    print("|---|" + "---|---|---|" * len(configs))
    for i, w in enumerate(workloads):
        cells = []
        for c in configs:
            r = results[c][i]
            cells += [f"{r['logical'] / 2**20:.1f}", f"{r['device'] / 2**20:.1f}",
                      f"{100 * (1 - r['device'] / r['logical']) if r['logical'] else 0:.1f}%"]
        print(f"| {w} | " + " | ".join(cells) + " |")
    print("\n### Throughput (application MB/s, fsyncs included) and server CPU seconds per GB of logical writes\n")
    print("| workload | " + " | ".join(f"{c}: MB/s | {c}: CPU s/GB" for c in configs) + " |")
    print("|---|" + "---|---|" * len(configs))
    for i, w in enumerate(workloads):
        cells = []
        for c in configs:
            r = results[c][i]
            cells += [f"{r['app_bytes'] / 1e6 / r['secs']:.1f}",
                      f"{r['cpu'] / (r['logical'] / 1e9) if r['logical'] else 0:.2f}"]
        print(f"| {w} | " + " | ".join(cells) + " |")
    print("\n### How the blocks were saved, and memory\n")
    print("| config | workload | WOJ shares | WOJ collisions | WOJ stale | confirmed by a read | dedup hits | pool bytes (journal blocks) | index table bytes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in configs:
        for r in results[c]:
            print(f"| {c} | {r['workload']} | {r['woj_hits']} | {r['woj_collisions']} | {r['woj_stale']} | "
                  f"{r['woj_by_read']} | {r['dedup_hits']} | {r['pool_bytes']} ({r['journal_blocks']}) | "
                  f"{r['index_bytes']} |")
    # The targets of issue 16, on the sequential and random fsync workloads.
    if "woj" in results and "blake3" in results:
        print("\n### Targets (sequential and random fsync workloads)\n")
        print("| workload | WOJ saved | WOJ saved of non-jbd2 blocks | BLAKE3 saved | WOJ / BLAKE3 reduction | BLAKE3 CPU / WOJ CPU (server s/GB) |")
        print("|---|---|---|---|---|---|")
        for i, w in enumerate(workloads):
            if not (w.startswith("seq") or w.startswith("rand")):
                continue
            a, b = results["woj"][i], results["blake3"][i]
            sa, sb = 1 - a["device"] / a["logical"], 1 - b["device"] / b["logical"]
            ca, cb = a["cpu"] / (a["logical"] / 1e9), b["cpu"] / (b["logical"] / 1e9)
            # jbd2's descriptor and commit blocks are written once, to the journal only.
            jb = 4096 * a.get("jbd2_blocks", 0)
            nj = a["logical"] - jb
            sj = 1 - (a["device"] - jb) / nj if nj > 0 else 0
            print(f"| {w} | {100 * sa:.1f}% | {100 * sj:.1f}% | {100 * sb:.1f}% | {100 * sa / sb if sb else 0:.1f}% | "
                  f"{cb / ca if ca else 0:.2f}x |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exe", default=os.path.join(ROOT, "target/release/dedupvol"))
    p.add_argument("--configs", default="none,blake3,woj,both")
    p.add_argument("--size", default="4G", help="volume and file system size")
    p.add_argument("--compression", default="none",
                   help="volume compression (none: blocks stored are blocks written; zstd: the default)")
    p.add_argument("--every", default="10,100,1000", help="fsync every N writes")
    p.add_argument("--seq-mib", type=int, default=64, help="sequential file size per run")
    p.add_argument("--rand-file-mib", type=int, default=256, help="file the random writes overwrite")
    p.add_argument("--rand-writes", type=int, default=16384)
    p.add_argument("--tree", default="/usr/share", help="tree to copy ('' to skip)")
    p.add_argument("--sqlite-txns", type=int, default=300)
    p.add_argument("--sqlite-rows", type=int, default=200)
    p.add_argument("--port", type=int, default=10950)
    p.add_argument("--json", help="also write the raw results here")
    args = p.parse_args()
    args.every = [int(x) for x in args.every.split(",")]
    configs = args.configs.split(",")
    if os.geteuid() != 0:
        sys.exit("bench-woj: needs root (mount -o loop)")
    for tool in ("nbdfuse", "fusermount3", "mkfs.ext4", "mount", "umount"):
        if not shutil.which(tool):
            sys.exit(f"bench-woj: {tool} not found (apt-get install nbdfuse e2fsprogs fuse3)")
    work = tempfile.mkdtemp(prefix="woj-bench-", dir="/tmp")
    results = {}
    try:
        for k, c in enumerate(configs):
            t = time.time()
            results[c] = run_config(args.exe, work, c, args, args.port + k)
            print(f"bench-woj: {c} done in {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nvolume {args.size}, compression {args.compression}, ext4 data=journal (default mkfs.ext4 journal); "
          f"sequential file {args.seq_mib} MiB; random: {args.rand_writes} writes over {args.rand_file_mib} MiB; "
          f"tree {args.tree or '-'}; sqlite {args.sqlite_txns} transactions of {args.sqlite_rows} rows")
    j = next((r[0]["ranges"] for r in results.values() if r and r[0].get("ranges")), None)
    if j:
        print(f"journal found by --woj auto: {j}")
    table(results, configs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
