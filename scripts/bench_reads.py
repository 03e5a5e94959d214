#!/usr/bin/env python3
"""dedupvol read benchmarks. Run through scripts/bench-reads.sh.

Sections (--sections, default all):
  nbd     the NBD matrix: fio (nbd engine, one connection) against `dedupvol serve` with
          default settings and against `nbdkit file` on the same disk, same seed, same
          data, at each --levels reducibility: sequential 1 MiB reads QD16, random 4 KiB
          reads QD32, a 70/30 read/write mix of 8K-128K, the SQL and VDI mixes, and the
          write jobs (sequential 1 MiB fill, random 4 KiB writes QD32) so a read change
          that costs writes shows. Jobs alternate between the two servers (A, B, A, B ...)
          so the VM's drift hits both alike. Each job also runs against `nbdkit null` (no
          storage at all): how much of nbdkit file's figure is nbdkit's own request
          handling rather than the file (--no-null skips it). The dedupvol server's peak RSS is printed
          beside its bound: --cache-size + index memory + block-map cache + 256 MiB.
  memory  equal memory: both servers inside one cgroup-v1 memory group whose limit counts
          the page cache (--memory-limit, default 1536M), on a region several times
          larger (--memory-region, default 8G) of 90 % reducible data: uniform 4 KiB random
          reads, zipf(1.1) 4 KiB random reads, sequential 1 MiB reads.
  replay  the SAR method: a skewed FIU-format trace (dedupvol trace generate) replayed on
          a slowed data device (a loop device under a blkio read/write throttle) against
          the raw device (native), a volume without a tier, and a volume with the tier on
          the fast disk; mean / p50 / p99 read and write response times.

Every number printed is measured in this run; results.json keeps each command verbatim.
Only the Python standard library is used.
"""

import argparse
import json
import re
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_suite as bs  # noqa: E402  (Server, fio, data_opts, run, rss_kib)

DEDUPVOL = bs.DEDUPVOL
MIB = 1 << 20


def parse_size(s):
    s = str(s).strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def read_jobs(runtime):
    """(name, kind, fio args): kind 'r' reads, 'w' writes, 'm' mixes."""
    t = ["--time_based", f"--runtime={runtime}"]
    sql_bs = "--bssplit=8k/50:64k/25:128k/25,8k/50:16k/25:96k/25"
    vdi_bs = "--bssplit=4k/60:16k/20:64k/20,4k/70:16k/20:64k/10"
    return [
        ("seq-read-1m-qd16", "r", ["--rw=read", "--bs=1m", "--iodepth=16", *t]),
        ("rand-read-4k-qd32", "r", ["--rw=randread", "--bs=4k", "--iodepth=32", *t]),
        ("mix-70-30-8k-128k", "m", ["--rw=randrw", "--rwmixread=70", "--bsrange=8k-128k", "--iodepth=16", *t]),
        ("sql-mix", "m", ["--rw=randrw", "--rwmixread=68", "--percentage_random=80", sql_bs, "--iodepth=32", *t]),
        ("vdi-mix", "m", ["--rw=randrw", "--rwmixread=68", "--percentage_random=90", vdi_bs, "--iodepth=32", *t]),
        ("rand-write-4k-qd32", "w", ["--rw=randwrite", "--bs=4k", "--iodepth=32", "--end_fsync=1", *t]),
    ]


def server_bound_mib(cache_bytes, vol):
    """The RSS bound: content cache + fingerprint index (its in-memory table and its
    record-page cache: at most 4096 pages of 101 records, 48 bytes each decoded)
    + block-map cache + 256 MiB."""
    info, _ = bs.run([DEDUPVOL, "info", vol])
    table = None
    units = {"B": 1, "KiB": 1 << 10, "MiB": MIB, "GiB": 1 << 30}
    for line in info.splitlines():
        # "index           dense (874328 slots of 6 B, 5.00 MiB), window 3.00 GiB in ..."
        m = re.match(r"index\s+\w+ \(\d+ slots of \d+ B, ([\d.]+) (B|KiB|MiB|GiB)\)", line)
        if m:
            table = float(m.group(1)) * units[m.group(2)]
    if table is None:
        raise RuntimeError(f"dedupvol info printed no index size:\n{info}")
    index = table + 4096 * 101 * 48
    return (cache_bytes + index + 128 * MIB + 256 * MIB) / MIB


def served_cache_bytes(srv, cache_size):
    """The content cache a server runs with: --cache-size, or what `auto` chose (its
    first stderr line, written before it listens)."""
    if cache_size != "auto":
        return parse_size(cache_size)
    line = srv.proc.stderr.readline()
    # "dedupvol: content cache 6017 MiB (--cache-size auto)"
    if "content cache" not in line:
        raise RuntimeError(f"dedupvol serve did not say its cache size: {line!r}")
    return int(line.split("content cache")[1].split("MiB")[0]) * MIB


def fio_job(uri, size, pct, args, name):
    return bs.fio(["--ioengine=nbd", f"--uri={uri}", f"--size={size}", "--randseed=42", *bs.data_opts(pct), *args], name)


def job_mb_s(res, kind):
    if kind == "r":
        return res["read"]["bw_mb_s"]
    if kind == "w":
        return res["write"]["bw_mb_s"]
    return res["read"]["bw_mb_s"] + res["write"]["bw_mb_s"]


def nbd_section(cfg, work, results):
    size = cfg["region"]
    rows = []
    for pct in cfg["levels"]:
        vol = work / "reads-dedupvol.img"
        raw = work / "reads-nbdkit.img"
        for p in (vol, raw):
            if p.exists():
                p.unlink()
        bs.run([DEDUPVOL, "format", vol, "--logical-size", size, "--physical-size", cfg["physical"], "--force",
                *cfg["format_args"]])
        bs.run(["truncate", "-s", size, raw])
        servers = {
            "dedupvol": bs.Server("dedupvol", vol, work / "dv.sock", extra=cfg["serve_args"]),
            "nbdkit": bs.Server("nbdkit", raw, work / "kit.sock"),
        }
        if cfg["null"]:
            # nbdkit without storage: its own request handling, the file taken away.
            servers["null"] = bs.Server("null", size, work / "null.sock")
        level = {"reducible_pct": pct, "jobs": {}, "cache_bytes": served_cache_bytes(servers["dedupvol"], cfg["cache_size"])}
        try:
            # The fill: the same sequential 1 MiB write of the same bytes on both.
            for kind, srv in servers.items():
                if kind == "null":
                    continue
                bs.log(f"fill {kind} at {pct}% reducible")
                r = fio_job(srv.uri, size, pct, ["--rw=write", "--bs=1m", "--iodepth=8", "--end_fsync=1"], "fill")
                level["jobs"].setdefault("seq-write-1m-qd8", {})[kind] = [r]
            for rnd in range(cfg["rounds"]):
                for name, kind, args in read_jobs(cfg["runtime"]):
                    if cfg["jobs"] and name not in cfg["jobs"]:
                        continue
                    order = ("dedupvol", "nbdkit") if rnd % 2 == 0 else ("nbdkit", "dedupvol")
                    if "null" in servers:
                        order = (*order, "null")
                    for k in order:
                        bs.log(f"{name} on {k} at {pct}% (round {rnd + 1})")
                        r = fio_job(servers[k].uri, size, pct, args, name)
                        level["jobs"].setdefault(name, {}).setdefault(k, []).append(r)
            level["rss_kib"] = {k: s.memory() for k, s in servers.items()}
        finally:
            for s in servers.values():
                s.stop()
        level["rss_bound_mib"] = server_bound_mib(level["cache_bytes"], vol)
        rows.append(level)
        results["nbd"] = rows
        save(results, cfg)
        for p in (vol, raw):
            p.unlink()
    print_nbd(rows)


CGROUP_MEM = Path("/sys/fs/cgroup/memory")


class MemGroup:
    """A cgroup-v1 memory group whose limit counts the page cache of its members."""

    def __init__(self, name, limit_bytes):
        self.path = CGROUP_MEM / name
        if self.path.exists():
            self.path.rmdir()
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))

    def add(self, pid):
        (self.path / "cgroup.procs").write_text(str(pid))

    def peak_bytes(self):
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def close(self):
        # Moving the group's page cache out is the kernel's job; an empty group can go.
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def drop_caches():
    subprocess.run(["sync"])
    Path("/proc/sys/vm/drop_caches").write_text("3")


def memory_jobs(runtime):
    t = ["--time_based", f"--runtime={runtime}"]
    return [
        ("rand-read-4k-uniform", ["--rw=randread", "--bs=4k", "--iodepth=32", *t]),
        ("rand-read-4k-zipf1.1", ["--rw=randread", "--bs=4k", "--iodepth=32", "--random_distribution=zipf:1.1", *t]),
        ("seq-read-1m-qd16", ["--rw=read", "--bs=1m", "--iodepth=16", *t]),
    ]


def memory_section(cfg, work, results):
    """Each server alone in a memory group of the same limit; a region far larger."""
    if not CGROUP_MEM.exists():
        raise RuntimeError("no cgroup-v1 memory controller at /sys/fs/cgroup/memory")
    size, limit, pct = cfg["memory_region"], parse_size(cfg["memory_limit"]), 90
    paths = {"dedupvol": work / "mem-dedupvol.img", "nbdkit": work / "mem-nbdkit.img"}
    for p in paths.values():
        if p.exists():
            p.unlink()
    bs.run([DEDUPVOL, "format", paths["dedupvol"], "--logical-size", size, "--physical-size",
            cfg["memory_physical"], "--force", *cfg["format_args"]])
    # The content cache takes what the RSS bound leaves in the group: the limit less the
    # fingerprint index, the block-map cache and 256 MiB for threads' buffers and
    # allocator slack (with less slack the group's limit can kill the server).
    cache = f"{max(64, int((limit >> 20) - server_bound_mib(0, paths['dedupvol'])))}M"
    out = {"limit_bytes": limit, "region": size, "reducible_pct": pct, "cache_size": cache, "jobs": {}}
    bs.run(["truncate", "-s", size, paths["nbdkit"]])
    extra = {"dedupvol": ["--cache-size", cache, *cfg["serve_args_nocache"]], "nbdkit": []}
    try:
        for kind, path in paths.items():
            drop_caches()
            g = MemGroup(f"dedupvol-bench-{kind}", limit)
            srv = bs.Server(kind, path, work / f"mem-{kind}.sock", extra=extra[kind], cgroup=g)
            try:
                bs.log(f"equal memory: fill {kind} ({size}, {pct}% reducible)")
                fio_job(srv.uri, size, pct, ["--rw=write", "--bs=1m", "--iodepth=8", "--end_fsync=1"], "fill")
            finally:
                srv.stop()
                g.close()
        out["rss_bound_mib"] = server_bound_mib(parse_size(cache), paths["dedupvol"])
        for rnd in range(cfg["rounds"]):
            for name, args in memory_jobs(cfg["runtime"]):
                order = ("dedupvol", "nbdkit") if rnd % 2 == 0 else ("nbdkit", "dedupvol")
                for kind in order:
                    drop_caches()
                    g = MemGroup(f"dedupvol-bench-{kind}", limit)
                    srv = bs.Server(kind, paths[kind], work / f"mem-{kind}.sock", extra=extra[kind], cgroup=g)
                    try:
                        # A warm-up pass the same length as the measurement: both servers
                        # start measuring with whatever their memory holds.
                        bs.log(f"equal memory: {name} on {kind} (round {rnd + 1})")
                        fio_job(srv.uri, size, pct, args, name + "-warm")
                        r = fio_job(srv.uri, size, pct, args, name)
                        r["group_peak_bytes"] = g.peak_bytes()
                        r["rss_kib"] = srv.memory()
                    finally:
                        srv.stop()
                        g.close()
                    out["jobs"].setdefault(name, {}).setdefault(kind, []).append(r)
                results["memory"] = out
                save(results, cfg)
    finally:
        for p in paths.values():
            if p.exists():
                p.unlink()
    print_memory(out)


def print_memory(out):
    print(f"\n## Equal memory: each server in a {out['limit_bytes'] >> 20} MiB memory cgroup (page cache "
          f"counted), {out['region']} region, {out['reducible_pct']}% reducible, dedupvol --cache-size "
          f"{out['cache_size']}; MB/s\n")
    print("| job | dedupvol | nbdkit | ratio | per-round ratios | group peak (dedupvol / nbdkit) |")
    print("|---|---|---|---|---|---|")
    for name, by in out["jobs"].items():
        d = [r["read"]["bw_mb_s"] for r in by.get("dedupvol", [])]
        n = [r["read"]["bw_mb_s"] for r in by.get("nbdkit", [])]
        per = ", ".join(f"{a / b:.2f}" for a, b in zip(d, n) if b)
        peak = "/".join(f"{max(r['group_peak_bytes'] for r in by.get(k, [{'group_peak_bytes': 0}])) >> 20}" for k in ("dedupvol", "nbdkit"))
        print(f"| {name} | {mean(d):.0f} | {mean(n):.0f} | {mean(d) / mean(n) if mean(n) else 0:.2f}x | {per} | {peak} MiB |")
    rss = max(((r.get("rss_kib") or (0, 0))[1] or 0) for by in out["jobs"].values() for r in by.get("dedupvol", []))
    bound = out.get("rss_bound_mib", 0)
    print(f"\ndedupvol peak RSS {rss / 1024:.0f} MiB, bound {bound:.0f} MiB (cache + index + block-map cache + 256 MiB): "
          f"{'within' if rss / 1024 <= bound else 'ABOVE'}")


CGROUP_BLKIO = Path("/sys/fs/cgroup/blkio")


class SlowDevice:
    """A loop device (direct I/O to its backing file) whose reads and writes are throttled
    by a cgroup-v1 blkio group: the slow data device of the tier runs. Processes in
    `self.group` see it at the throttled rate."""

    def __init__(self, backing, size, read_iops, write_iops, bps):
        bs.run(["truncate", "-s", size, backing])
        out, _ = bs.run(["losetup", "--find", "--show", "--direct-io=on", backing])
        self.dev = out.strip()
        st = os.stat(self.dev)
        majmin = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        self.group = CGROUP_BLKIO / "dedupvol-bench-slow"
        if not self.group.exists():
            self.group.mkdir()
        for f, v in (("read_iops_device", read_iops), ("write_iops_device", write_iops),
                     ("read_bps_device", bps), ("write_bps_device", bps)):
            (self.group / f"blkio.throttle.{f}").write_text(f"{majmin} {v}")
        self.limits = {"read_iops": read_iops, "write_iops": write_iops, "bps": bps}

    def run_in_group(self, cmd):
        """Runs cmd (list) inside the throttled group; returns its stdout."""
        pre = lambda: (self.group / "cgroup.procs").write_text(str(os.getpid()))  # noqa: E731
        bs.COMMANDS.append(" ".join(map(str, cmd)) + f"   # in blkio group {self.group.name}")
        p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, preexec_fn=pre, timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"command failed ({p.returncode}): {' '.join(map(str, cmd))}\n{p.stderr}")
        return p.stdout

    def close(self):
        subprocess.run(["losetup", "-d", self.dev])
        try:
            self.group.rmdir()
        except OSError:
            pass


def replay_section(cfg, work, results):
    """Native device, volume without tier, volume with the tier on the fast disk; all on
    the same throttled data device, the same trace, the same small content cache."""
    trace = work / "replay.fiu"
    gen, _ = bs.run([DEDUPVOL, "trace", "generate", trace, "--ops", cfg["replay_ops"], "--blocks",
                     cfg["replay_blocks"], "--seed", "7", "--json"])
    out = {"trace_stats": json.loads(gen), "runs": {}}
    slow = SlowDevice(work / "slow.img", cfg["replay_device"], cfg["slow_read_iops"], cfg["slow_write_iops"],
                      cfg["slow_bps"])
    out["slow_device"] = slow.limits
    tier = work / "tier.img"
    common = ["--json", "--timing", "fast", "--queue-depth", "8", "--compress-pct", "70"]
    vol_opts = ["--cache-size", cfg["replay_cache"]]
    try:
        runs = [
            ("native", ["--target", f"file:{slow.dev}", "--direct"]),
            ("dedup, no tier", ["--target", f"vol:{slow.dev}", *vol_opts]),
            ("dedup + tier", ["--target", f"vol:{slow.dev}", *vol_opts, "--tier-device", tier,
                              "--tier-size", cfg["tier_size"]]),
            # The paper's policy alone: copies only for references or re-reads, no fills.
            ("dedup + tier, hot blocks only", ["--target", f"vol:{slow.dev}", *vol_opts, "--tier-device", tier,
                                               "--tier-size", cfg["tier_size"], "--tier-fill-percent", "0"]),
            # A tier smaller than the data stored: what gets in matters.
            ("dedup + small tier", ["--target", f"vol:{slow.dev}", *vol_opts, "--tier-device", tier,
                                    "--tier-size", cfg["small_tier_size"]]),
        ]
        for name, args in runs:
            bs.run(["dd", "if=/dev/zero", f"of={slow.dev}", "bs=1M", "count=64", "oflag=direct", "status=none"])
            if name != "native":
                bs.run([DEDUPVOL, "format", slow.dev, "--logical-size", cfg["replay_device"], "--force"])
            if tier.exists():
                tier.unlink()
            bs.log(f"replay: {name}")
            j = json.loads(slow.run_in_group([DEDUPVOL, "replay", trace, *common, *args]))
            out["runs"][name] = j
            results["replay"] = out
            save(results, cfg)
    finally:
        slow.close()
        for p in (trace, tier, work / "slow.img"):
            if p.exists():
                p.unlink()
    print_replay(out)


def print_replay(out):
    st = out["trace_stats"]
    lim = out["slow_device"]
    print(f"\n## Trace replay (FIU format, generated; {st['spec']['ops']} requests) on a data device "
          f"throttled to {lim['read_iops']} read / {lim['write_iops']} write IOPS and {lim['bps'] >> 20} MiB/s; "
          "queue depth 8; response times in µs\n")
    print("| target | read mean | read p50 | read p99 | write mean | write p99 | total s |")
    print("|---|---|---|---|---|---|---|")
    for name, j in out["runs"].items():
        r, w = j["reads"], j["writes"]
        print(f"| {name} | {r['mean_us']:.0f} | {r['p50_us']:.0f} | {r['p99_us']:.0f} | {w['mean_us']:.0f} | "
              f"{w['p99_us']:.0f} | {j['seconds']:.1f} |")
    runs = out["runs"]
    if "dedup, no tier" in runs:
        a = runs["dedup, no tier"]["reads"]["mean_us"]
        print()
        for name, j in runs.items():
            if "tier" in name and name != "dedup, no tier":
                t = (j.get("engine") or {}).get("tier") or {}
                print(f"- mean read response time without tier / {name}: {a / j['reads']['mean_us']:.2f}x "
                      f"(tier: {t.get('entries', '?')} of {t.get('capacity_slots', '?')} slots, "
                      f"{t.get('hits', '?')} hits, {t.get('misses', '?')} data device reads, "
                      f"{t.get('fills', 0)} fills, {t.get('promotions_write', '?')} + "
                      f"{t.get('promotions_read', '?')} promotions, {t.get('demotions', '?')} demotions)")


def mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def print_nbd(rows):
    kinds = {n: k for n, k, _ in read_jobs(1)}
    kinds["seq-write-1m-qd8"] = "w"
    print("\n## NBD matrix: dedupvol serve (defaults) vs nbdkit file, MB/s (mean of rounds)\n")
    print("nbdkit null: the same job against `nbdkit null` (stores nothing, reads zeros): nbdkit's")
    print("own request handling and the transport, without the file. Where it is close to nbdkit")
    print("file, nbdkit's figure is bound by its request handling, not by storage. fio CPU: the")
    print("client's own CPU in % of one core (its one thread), against dedupvol / nbdkit file; near")
    print("100, the client is the limit.\n")
    print("| reducible | job | dedupvol | nbdkit | ratio | per-round ratios | nbdkit null | null / file | fio CPU |")
    print("|---|---|---|---|---|---|---|---|---|")
    for lv in rows:
        for name, by in lv["jobs"].items():
            d = [job_mb_s(r, kinds[name]) for r in by.get("dedupvol", [])]
            n = [job_mb_s(r, kinds[name]) for r in by.get("nbdkit", [])]
            c = [job_mb_s(r, kinds[name]) for r in by.get("null", [])]
            per = ", ".join(f"{a / b:.2f}" for a, b in zip(d, n) if b)
            ratio = mean(d) / mean(n) if mean(n) else 0
            null = f"{mean(c):.0f} | {mean(c) / mean(n):.2f}x" if c and mean(n) else "- | -"
            cpu = "/".join(f"{mean([r.get('client_cpu_pct', 0.0) for r in by.get(k, [])]):.0f}"
                           for k in ("dedupvol", "nbdkit"))
            print(f"| {lv['reducible_pct']}% | {name} | {mean(d):.0f} | {mean(n):.0f} | {ratio:.2f}x | {per} | {null} | {cpu} |")
    print("\n| reducible | dedupvol peak RSS | bound (cache + index + block-map cache + 256 MiB) | cache | nbdkit peak RSS |")
    print("|---|---|---|---|---|")
    for lv in rows:
        d = (lv["rss_kib"].get("dedupvol") or (0, 0))[1] or 0
        n = (lv["rss_kib"].get("nbdkit") or (0, 0))[1] or 0
        ok = "within" if d / 1024 <= lv["rss_bound_mib"] else "ABOVE"
        print(f"| {lv['reducible_pct']}% | {d / 1024:.0f} MiB | {lv['rss_bound_mib']:.0f} MiB ({ok}) | "
              f"{lv.get('cache_bytes', 0) >> 20} MiB | {n / 1024:.0f} MiB |")


def save(results, cfg):
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    results["commands"] = bs.COMMANDS
    (out / "results.json").write_text(json.dumps(results, indent=1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="nbd,memory,replay")
    ap.add_argument("--levels", default="0,90")
    ap.add_argument("--region", default="2G")
    ap.add_argument("--physical", default="4G")
    ap.add_argument("--runtime", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cache-size", default="auto", help="dedupvol serve --cache-size (default: the server's own)")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra argument for dedupvol serve")
    ap.add_argument("--format-arg", action="append", default=[],
                    help="extra argument for dedupvol format in the nbd and memory sections (e.g. --format-arg=--extent-max=16K)")
    ap.add_argument("--memory-limit", default="1536M")
    ap.add_argument("--memory-region", default="8G")
    ap.add_argument("--memory-physical", default="6G")
    ap.add_argument("--jobs", default="", help="comma-separated job names (default: all)")
    ap.add_argument("--no-null", action="store_true",
                    help="nbd: skip the jobs against nbdkit null (nbdkit without storage)")
    ap.add_argument("--replay-ops", default="100000")
    ap.add_argument("--replay-blocks", default="262144", help="4 KiB blocks the trace addresses")
    ap.add_argument("--replay-device", default="2G")
    ap.add_argument("--replay-cache", default="8M", help="content cache of the replayed volumes")
    ap.add_argument("--tier-size", default="256M")
    ap.add_argument("--small-tier-size", default="8M",
                    help="the tier of the 'small tier' replay run, meant to be smaller than the data the trace stores")
    ap.add_argument("--slow-read-iops", type=int, default=2000)
    ap.add_argument("--slow-write-iops", type=int, default=4000)
    ap.add_argument("--slow-bps", type=int, default=200 << 20)
    ap.add_argument("--work", default="/var/tmp/dedupvol-reads")
    ap.add_argument("--out", default="/var/tmp/dedupvol-reads/report")
    a = ap.parse_args()
    cfg = {
        "levels": [int(x) for x in a.levels.split(",") if x],
        "region": a.region,
        "physical": a.physical,
        "null": not a.no_null,
        "runtime": a.runtime,
        "rounds": a.rounds,
        "jobs": [j for j in a.jobs.split(",") if j],
        "cache_size": a.cache_size,
        "serve_args": ["--cache-size", a.cache_size, *a.serve_arg],
        "serve_args_nocache": a.serve_arg,
        "format_args": a.format_arg,
        "memory_limit": a.memory_limit,
        "memory_region": a.memory_region,
        "memory_physical": a.memory_physical,
        "replay_ops": a.replay_ops,
        "replay_blocks": a.replay_blocks,
        "replay_device": a.replay_device,
        "replay_cache": a.replay_cache,
        "tier_size": a.tier_size,
        "small_tier_size": a.small_tier_size,
        "slow_read_iops": a.slow_read_iops,
        "slow_write_iops": a.slow_write_iops,
        "slow_bps": a.slow_bps,
        "out": a.out,
    }
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    # Run a private copy, so a rebuild mid-run cannot mix two binaries.
    global DEDUPVOL
    private = work / "dedupvol"
    shutil.copy2(DEDUPVOL, private)
    DEDUPVOL = bs.DEDUPVOL = private
    results = {"config": cfg, "machine": bs.machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    sections = a.sections.split(",")
    if "nbd" in sections:
        nbd_section(cfg, work, results)
    if "memory" in sections:
        memory_section(cfg, work, results)
    if "replay" in sections:
        replay_section(cfg, work, results)
    save(results, cfg)


if __name__ == "__main__":
    main()
