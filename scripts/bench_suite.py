#!/usr/bin/env python3
"""dedupvol side-by-side benchmark suite. Run it through scripts/bench-suite.sh.

Runs, in one go and on one disk:
  1. the machine's limits: BLAKE3 / LZ4 / zstd-1 MB/s on one core (dedupvol bench --mode
     primitives), disk sequential and random bandwidth (fio, O_DIRECT, on the work dir);
  2. fio over NBD against `dedupvol serve` and against `nbdkit file` (the no-reduction
     baseline) on the same disk: sequential 1 MiB writes, random 4 KiB writes (QD 32),
     random 4 KiB reads (QD 32), SQL and VDI access mixes, at 0/50/75/90 % reducible data;
  3. the in-process speed targets (dedupvol bench --mode targets) and the I/O overhead
     breakdown of random 4 KiB writes with 90 % reducible data;
  4. ingest of real data (full mode): several linux-source-6.1 tars and an ext4 image of a
     Debian tree, into dedupvol, borg, restic and `qemu-img convert -c`;
  5. server memory (peak RSS) of dedupvol serve and nbdkit.

Every command is recorded verbatim in results.json; scripts/bench_report.py turns it into
Markdown + SVG. "X % reducible" data is split evenly between dedup and compression:
dedup share d and compression share c with (1 - d)(1 - c) = 1 - X, d = c.

Only the Python standard library is used.
"""

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEDUPVOL = REPO / "target" / "release" / "dedupvol"
COMMANDS = []  # every external command, in order, for the report


def log(msg):
    print(f"[suite {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd, check=True, env=None, capture=True, timeout=None):
    """Runs cmd (a list), records it, returns (stdout, seconds)."""
    COMMANDS.append(" ".join(str(c) for c in cmd))
    t = time.monotonic()
    p = subprocess.run(
        [str(c) for c in cmd],
        stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.PIPE if capture else None,
        env=env,
        timeout=timeout,
        text=True,
    )
    dt = time.monotonic() - t
    if check and p.returncode != 0:
        raise RuntimeError(f"command failed ({p.returncode}): {' '.join(map(str, cmd))}\n{p.stderr}\n{p.stdout[-2000:] if p.stdout else ''}")
    return (p.stdout or ""), dt


def loadavg():
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return None


def split_reducible(pct):
    """Even split of X % reducible into (dedup %, compression %)."""
    f = 1.0 - math.sqrt(1.0 - pct / 100.0)
    return round(f * 100.0, 1), round(f * 100.0, 1)


def rss_kib(pid):
    """(VmRSS, VmHWM) of a live process in KiB."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                out[k] = int(v.split()[0])
    except OSError:
        pass
    return out.get("VmRSS"), out.get("VmHWM")


class Server:
    """dedupvol serve or nbdkit file on a Unix socket; waits for readiness, not a sleep."""

    def __init__(self, kind, path, sock, extra=(), cgroup=None):
        """cgroup: an object with add(pid), to put the server in a memory group before it
        touches any data (a child joins it through preexec_fn, before exec). kind "null":
        `nbdkit null` of `path` bytes (a size): nbdkit storing nothing and reading zeros,
        its request handling without storage."""
        self.kind = kind
        pre = None
        if cgroup is not None:
            pre = lambda: cgroup.add(os.getpid())  # noqa: E731
        self.sock = sock
        if sock.exists():
            sock.unlink()
        if kind == "dedupvol":
            cmd = [DEDUPVOL, "serve", path, "--socket", sock, *extra]
            COMMANDS.append(" ".join(map(str, cmd)))
            self.proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         preexec_fn=pre)
            line = self.proc.stdout.readline()
            if not line.startswith("dedupvol: serving"):
                err = self.proc.stderr.read() if self.proc.poll() is not None else ""
                raise RuntimeError(f"dedupvol serve did not start: {line!r} {err}")
            self.uri = f"nbd+unix:///dedupvol?socket={sock}"
        else:
            pidfile = sock.with_suffix(".pid")
            if pidfile.exists():
                pidfile.unlink()
            plugin = ["null", f"size={path}"] if kind == "null" else ["file", f"file={path}"]
            cmd = ["nbdkit", "-f", "-U", sock, "--pidfile", pidfile, *plugin]
            COMMANDS.append(" ".join(map(str, cmd)))
            self.proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                         preexec_fn=pre)
            # nbdkit writes the pidfile once it accepts connections.
            deadline = time.monotonic() + 30
            while not pidfile.exists():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"nbdkit did not start: {self.proc.stderr.read() if self.proc.poll() is not None else 'timeout'}")
                time.sleep(0.05)
            self.uri = f"nbd+unix:///?socket={sock}"

    def memory(self):
        return rss_kib(self.proc.pid)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.proc.returncode


def fio(args, name):
    out, dt = run(["fio", f"--name={name}", "--output-format=json", *args], timeout=1800)
    # fio may print warnings before the JSON.
    j = json.loads(out[out.index("{"):])
    job = j["jobs"][0]
    res = {"seconds": dt}
    for d in ("read", "write"):
        x = job[d]
        res[d] = {
            "bw_mb_s": x["bw_bytes"] / 1e6,
            "iops": x["iops"],
            "bytes": x["io_bytes"],
            "clat_mean_us": x["clat_ns"]["mean"] / 1000.0,
            "clat_p99_us": (x["clat_ns"].get("percentile") or {}).get("99.000000", 0) / 1000.0,
        }
    res["runtime_s"] = job["job_runtime"] / 1000.0
    # fio's own CPU, in % of one core (its job runs on one thread): near 100, the client
    # is the limit, whatever the server.
    res["client_cpu_pct"] = job.get("usr_cpu", 0.0) + job.get("sys_cpu", 0.0)
    return res


def data_opts(pct):
    d, c = split_reducible(pct)
    opts = ["--refill_buffers"]
    if d > 0:
        # fio keeps the working set's pages unique, so it must leave room for the duplicates.
        ws = min(50, int(100 - d) - 1)
        opts += [f"--dedupe_percentage={d}", "--dedupe_mode=working_set", f"--dedupe_working_set_percentage={ws}"]
    if c > 0:
        opts += [f"--buffer_compress_percentage={c}", "--buffer_compress_chunk=4096"]
    return opts


def nbd_jobs(cfg):
    """(name, fio args) of the NBD matrix; the seq write fills the region first."""
    R = str(cfg["runtime_s"])
    sql_bs = "--bssplit=8k/50:64k/25:128k/25,8k/50:16k/25:96k/25"
    timed = ["--time_based", f"--runtime={R}"]
    return [
        ("seq-write-1m", ["--rw=write", "--bs=1m", "--iodepth=8", "--end_fsync=1"]),
        ("rand-write-4k-qd32", ["--rw=randwrite", "--bs=4k", "--iodepth=32", "--end_fsync=1", *timed]),
        ("rand-read-4k-qd32", ["--rw=randread", "--bs=4k", "--iodepth=32", *timed]),
        ("sql-mix", ["--rw=randrw", "--rwmixread=68", "--percentage_random=80", sql_bs, "--iodepth=32", "--end_fsync=1", *timed]),
        ("vdi-mix", ["--rw=randrw", "--rwmixread=68", "--percentage_random=80", sql_bs, "--iodepth=32", "--end_fsync=1", *timed]),
    ]


def nbd_matrix(cfg, work, results):
    size = cfg["nbd_region"]
    out = []
    for pct in cfg["levels"]:
        for kind in ("dedupvol", "nbdkit"):
            path = work / f"nbd-{kind}.img"
            if path.exists():
                path.unlink()
            if kind == "dedupvol":
                run([DEDUPVOL, "format", path, "--logical-size", size, "--physical-size", cfg["nbd_physical"],
                     "--compression", "lz4", "--write-policy", "async", "--force"])
            else:
                run(["truncate", "-s", size, path])
            srv = Server(kind, path, work / "nbd.sock")
            entry = {"target": kind, "reducible_pct": pct, "dedup_pct": split_reducible(pct)[0],
                     "compress_pct": split_reducible(pct)[1], "jobs": {}, "load_before": loadavg()}
            try:
                for name, args in nbd_jobs(cfg):
                    d = data_opts(pct) if name != "vdi-mix" else data_opts(pct)
                    log(f"fio {name} on {kind} at {pct}% reducible")
                    entry["jobs"][name] = fio(["--ioengine=nbd", f"--uri={srv.uri}", f"--size={size}",
                                               "--randseed=42", *d, *args], name)
                rss, hwm = srv.memory()
                entry["rss_kib"], entry["peak_rss_kib"] = rss, hwm
            finally:
                entry["exit"] = srv.stop()
            if kind == "dedupvol":
                try:
                    s, _ = run([DEDUPVOL, "stats", path, "--json"])
                    st = json.loads(s)
                    entry["stats"] = {k: st.get(k) for k in ("reduction_ratio", "logical_bytes_used",
                                                           "physical_data_bytes_used", "savings", "metadata_bytes")}
                except Exception as e:  # stats is reported when available, never invented
                    entry["stats_error"] = str(e)
            entry["load_after"] = loadavg()
            path.unlink()
            out.append(entry)
            results["nbd"] = out
            save(results, cfg)
    return out


def disk_limits(cfg, work):
    f = work / "fio-disk.dat"
    size = cfg["disk_size"]
    common = [f"--filename={f}", "--ioengine=libaio", "--direct=1", f"--size={size}", "--refill_buffers"]
    R = str(cfg["runtime_s"])
    res = {
        "seq-write-1m-qd16": fio([*common, "--rw=write", "--bs=1m", "--iodepth=16", "--end_fsync=1"], "disk-seq-write"),
        "rand-write-4k-qd32": fio([*common, "--rw=randwrite", "--bs=4k", "--iodepth=32", "--time_based", f"--runtime={R}", "--end_fsync=1"], "disk-rand-write"),
        "rand-read-4k-qd32": fio([*common, "--rw=randread", "--bs=4k", "--iodepth=32", "--time_based", f"--runtime={R}"], "disk-rand-read"),
    }
    f.unlink()
    return res


def dedupvol_bench(args, work):
    out, dt = run([DEDUPVOL, "bench", *args, "--dir", work, "--json"], timeout=3600)
    j = json.loads(out)
    j["wall_seconds"] = dt
    return j


def kernel_tars(cfg, cache):
    """Downloads (apt-get download) and unpacks linux-source-6.1 versions; returns tar paths."""
    madison, _ = run(["apt-cache", "madison", "linux-source-6.1"])
    versions = sorted({l.split("|")[1].strip() for l in madison.splitlines() if "|" in l})
    versions = versions[: cfg["kernel_versions"]] if cfg["kernel_versions"] else versions
    debs = cache / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    tars = []
    for v in versions:
        deb = debs / f"linux-source-6.1_{v}_all.deb"
        if not deb.exists():
            p = subprocess.run(["apt-get", "download", f"linux-source-6.1={v}"], cwd=debs)
            COMMANDS.append(f"(cd {debs} && apt-get download linux-source-6.1={v})")
            if p.returncode != 0:
                log(f"could not download linux-source-6.1={v}; skipped")
                continue
        tar = cache / f"linux-source-6.1_{v}.tar"
        if not tar.exists():
            log(f"unpacking {deb.name}")
            tmp = tar.with_suffix(".tmp")
            cmd = (f"dpkg-deb --fsys-tarfile {deb} | tar -xO --wildcards './usr/src/linux-source-6.1*.tar.xz' "
                   f"| xz -dc -T0 > {tmp} && mv {tmp} {tar}")
            COMMANDS.append(cmd)
            subprocess.run(cmd, shell=True, check=True)
        tars.append(tar)
    return tars


def debian_ext4_image(cfg, cache):
    img = cache / "debian-usr.ext4"
    if img.exists():
        return img
    used_kib = int(subprocess.run(["du", "-sk", "/usr"], capture_output=True, text=True).stdout.split()[0])
    size_mib = int(used_kib * 1.4 / 1024) + 512
    tmp = img.with_suffix(".tmp")
    log(f"building an ext4 image of /usr ({size_mib} MiB)")
    run(["mke2fs", "-q", "-F", "-t", "ext4", "-b", "4096", "-d", "/usr", tmp, f"{size_mib}M"])
    tmp.rename(img)
    return img


def du_bytes(p):
    return int(subprocess.run(["du", "-sb", str(p)], capture_output=True, text=True).stdout.split()[0])


def ingest(cfg, name, files, work):
    """Each tool on the same files: stored bytes, ratio, MB/s."""
    total = sum(f.stat().st_size for f in files)
    res = {"dataset": name, "files": [str(f) for f in files], "input_bytes": total, "tools": {}}
    # dedupvol, in-process (page cache warmed by its estimate pass).
    try:
        args = ["--mode", "ingest", "--no-disk", "--no-baseline"]
        for f in files:
            args += ["--file", f]
        j = dedupvol_bench(args, work)
        s = j["scenarios"][0]
        if s.get("engine"):
            st = s["stats"]
            res["tools"]["dedupvol (LZ4, 4 KiB)"] = {
                "seconds": s["engine"]["seconds"], "mb_s": s["engine"]["mb_s"],
                "stored_bytes": st["physical_data_bytes_used"], "ratio": total / max(1, st["physical_data_bytes_used"]),
                "engine_reduction_ratio": st["reduction_ratio"],
            }
        else:
            res["tools"]["dedupvol (LZ4, 4 KiB)"] = {"error": s.get("engine_error")}
        est = s["estimate"]
        res["estimate"] = {k: est[k] for k in ("reduction_ratio", "total_reduction_ratio", "physical_bytes",
                                                "savings_zero_bytes", "savings_dedup_bytes", "savings_compression_bytes")}
    except Exception as e:
        res["tools"]["dedupvol (LZ4, 4 KiB)"] = {"error": str(e)}
    # What the estimate predicts at each chunk size (the engine itself uses 4 KiB).
    res["estimate_by_chunk"] = {}
    for cs in ("4K", "8K", "16K", "32K"):
        try:
            o, dt = run([DEDUPVOL, "estimate", "--chunk-size", cs, "--json", *files], timeout=3600)
            e = json.loads(o)["estimate"]
            res["estimate_by_chunk"][cs] = {k: e[k] for k in ("total_reduction_ratio", "savings_zero_bytes", "savings_dedup_bytes",
                                                               "savings_compression_bytes", "compression_gross_bytes", "physical_bytes", "mb_per_s")}
        except Exception as ex:
            res["estimate_by_chunk"][cs] = {"error": str(ex)}
    # Page cache is warm for every tool below as well (same files, just read).
    if shutil.which("borg"):
        repo = work / "borg-repo"
        shutil.rmtree(repo, ignore_errors=True)
        env = dict(os.environ, BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK="yes", BORG_RELOCATED_REPO_ACCESS_IS_OK="yes")
        run(["borg", "init", "--encryption=none", repo], env=env)
        _, dt = run(["borg", "create", "--compression", "lz4", f"{repo}::a", *files], env=env, timeout=7200)
        stored = du_bytes(repo)
        res["tools"]["borg 1.2 (lz4, CDC)"] = {"seconds": dt, "mb_s": total / dt / 1e6, "stored_bytes": stored, "ratio": total / stored}
        shutil.rmtree(repo, ignore_errors=True)
    if shutil.which("restic"):
        repo = work / "restic-repo"
        shutil.rmtree(repo, ignore_errors=True)
        env = dict(os.environ, RESTIC_PASSWORD="bench", RESTIC_CACHE_DIR=str(work / "restic-cache"))
        run(["restic", "init", "--repo", repo, "--repository-version", "2"], env=env)
        _, dt = run(["restic", "backup", "--repo", repo, "--compression", "auto", *files], env=env, timeout=7200)
        stored = du_bytes(repo)
        res["tools"]["restic 0.14 (zstd auto, CDC)"] = {"seconds": dt, "mb_s": total / dt / 1e6, "stored_bytes": stored, "ratio": total / stored}
        shutil.rmtree(repo, ignore_errors=True)
        shutil.rmtree(work / "restic-cache", ignore_errors=True)
    if shutil.which("qemu-img"):
        stored, secs = 0, 0.0
        for i, f in enumerate(files):
            out = work / f"qemu-{i}.qcow2"
            # -m 8 -W: parallel, out-of-order compressed writes (qemu's compression uses a thread pool).
            _, dt = run(["qemu-img", "convert", "-c", "-m", "8", "-W", "-f", "raw", "-O", "qcow2", f, out], timeout=7200)
            secs += dt
            stored += du_bytes(out)
            out.unlink()
        res["tools"]["qemu-img convert -c (qcow2 zlib, no dedup)"] = {"seconds": secs, "mb_s": total / secs / 1e6, "stored_bytes": stored, "ratio": total / stored}
    return res


def machine():
    def sh(c):
        return subprocess.run(c, shell=True, capture_output=True, text=True).stdout.strip()
    return {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu": sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2").strip(),
        "cores": os.cpu_count(),
        "memory": sh("free -h | awk '/Mem:/{print $2}'"),
        "kernel": sh("uname -r"),
        "os": sh(". /etc/os-release && echo $PRETTY_NAME"),
        "commit": sh(f"git -C {REPO} rev-parse --short HEAD"),
        "dirty": bool(sh(f"git -C {REPO} status --porcelain --untracked-files=no")),
        "fio": sh("fio --version"),
        "nbdkit": sh("nbdkit --version"),
        "borg": sh("borg --version 2>/dev/null"),
        "restic": sh("restic version 2>/dev/null"),
        "qemu_img": sh("qemu-img --version | head -1"),
    }


def save(results, cfg):
    results["commands"] = COMMANDS
    cfg["out"].mkdir(parents=True, exist_ok=True)
    (cfg["out"] / "results.json").write_text(json.dumps(results, indent=1, default=str))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI smoke: small sizes, 2 levels, no real-data ingest (< 3 min)")
    ap.add_argument("--work", default="/var/tmp/dedupvol-suite", help="scratch dir on the disk under test")
    ap.add_argument("--cache", default="/var/tmp/dedupvol-bench-cache", help="downloads and unpacked inputs")
    ap.add_argument("--out", default=None, help="report dir (default: docs/benchmarks/DATE for full, WORK/report for --quick)")
    ap.add_argument("--kernel-versions", type=int, default=6, help="linux-source-6.1 versions to ingest (0 = all)")
    ap.add_argument("--ingest-sets", default="kernel,ext4", help="real data sets of the full ingest: kernel,ext4")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: limits,nbd,targets,overhead,ingest")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    # Run a private copy, so a rebuild by someone else mid-run cannot mix two binaries.
    global DEDUPVOL
    private = work / "dedupvol"
    shutil.copy2(DEDUPVOL, private)
    DEDUPVOL = private
    cache = Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    date = time.strftime("%Y-%m-%d", time.gmtime())
    out = Path(a.out) if a.out else (work / "report" if a.quick else REPO / "docs" / "benchmarks" / date)
    skip = set(s for s in a.skip.split(",") if s)
    if a.quick:
        cfg = dict(mode="quick", levels=[0, 90], runtime_s=2, nbd_region="256M", nbd_physical="1G", disk_size="128M",
                   seq_size="128M", ow_range="128M", ow_writes=20000)
    else:
        cfg = dict(mode="full", levels=[0, 50, 75, 90], runtime_s=15, nbd_region="2G", nbd_physical="8G", disk_size="2G",
                   seq_size="2G", ow_range="4G", ow_writes=400000)
    cfg.update(out=out, kernel_versions=a.kernel_versions)
    results = {"machine": machine(), "config": {k: v for k, v in cfg.items() if k != "out"}, "work_dir": str(work),
               "argv": sys.argv, "load_start": loadavg()}
    save(results, cfg)
    t0 = time.monotonic()

    if "limits" not in skip:
        log("machine limits: CPU primitives")
        results["primitives"] = {
            f"{d}/{c}": dedupvol_bench(["--mode", "primitives", "--dup", str(d), "--compress", str(c)]
                                       + (["--no-disk"] if (d, c) != (0, 0) or a.quick else []), work)
            for d, c in [(0, 0), (0, 50), (75, 50)]
        }
        log("machine limits: disk (fio, O_DIRECT)")
        results["disk"] = disk_limits(cfg, work)
        save(results, cfg)
    if "nbd" not in skip:
        nbd_matrix(cfg, work, results)
    if "overhead" not in skip:
        d, c = split_reducible(90)
        log(f"I/O overhead breakdown: random 4 KiB overwrites, 90% reducible ({d}% dup, {c}% compressible)")
        results["overhead"] = dedupvol_bench(["--mode", "overwrite", "--dup", str(d), "--compress", str(c),
                                              "--range", cfg["ow_range"], "--writes", str(cfg["ow_writes"]), "--no-disk"], work)
        results["overhead_seq"] = dedupvol_bench(["--mode", "seq", "--dup", str(d), "--compress", str(c),
                                                  "--size", cfg["seq_size"], "--no-disk"], work)
        save(results, cfg)
    tars = []
    sets = set(a.ingest_sets.split(","))
    if "ingest" not in skip and not a.quick and "kernel" in sets:
        try:
            tars = kernel_tars(cfg, cache)
        except Exception as e:
            results["ingest_error"] = f"kernel sources: {e}"
    if "targets" not in skip:
        log("speed targets (in-process)")
        args = ["--mode", "targets", "--size", cfg["seq_size"], "--range", cfg["ow_range"], "--writes", str(cfg["ow_writes"])]
        if tars:
            args += ["--file", tars[0]]
        results["targets"] = dedupvol_bench(args, work)
        save(results, cfg)
    if "ingest" not in skip:
        results["ingest"] = []
        if a.quick:
            g = work / "vdi-256m.bin"
            run([DEDUPVOL, "gen", "--preset", "vdi", "--size", "256M", "--seed", "1", "-o", g])
            results["ingest"].append(ingest(cfg, "generated VDI-like data (dedupvol gen --preset vdi, 256 MiB)", [g], work))
            g.unlink()
        else:
            if tars:
                log(f"ingest: {len(tars)} kernel source tars")
                results["ingest"].append(ingest(cfg, f"{len(tars)} linux-source-6.1 tars", tars, work))
                save(results, cfg)
            try:
                if "ext4" not in sets:
                    raise RuntimeError("skipped (--ingest-sets)")
                img = debian_ext4_image(cfg, cache)
                log("ingest: ext4 image of /usr")
                results["ingest"].append(ingest(cfg, "ext4 image of a Debian bookworm /usr tree (mke2fs -d /usr)", [img], work))
            except Exception as e:
                results["ingest_error"] = f"ext4 image: {e}"
        save(results, cfg)

    results["load_end"] = loadavg()
    results["suite_seconds"] = time.monotonic() - t0
    save(results, cfg)
    run([sys.executable, REPO / "scripts" / "bench_report.py", out / "results.json", out])
    log(f"done in {results['suite_seconds']:.0f} s; report in {out}")


if __name__ == "__main__":
    main()
