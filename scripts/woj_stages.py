#!/usr/bin/env python3
"""CPU of the write path by stage, for BLAKE3 dedup and write-once journaling (WOJ).

Profiles `dedupvol bench --mode woj` (the engine alone, in process, on an ext4
data=journal write stream: see crates/dedupvol-cli/src/woj_bench.rs) with `perf record`
and DWARF call graphs, one configuration at a time, and gives every sample to the stage
whose function is on its stack:

  1 fingerprint        pipeline::fingerprint (zero check, crc32c, xxh3, BLAKE3, pool lookups)
  2 candidates         reduce::resolve_woj, reduce::find_candidates (pool / index, lock held)
  3 verify, compress   reduce::verify_and_compress (byte comparison, compression)
  4 place              place_batch (sharing, staging, map, reference counts, pool update)
  data writes          the data writer and staging hand-off (device writes)
  journal, flush       commit and flush (metadata journal)
  write path, other    the rest of Volume::write (request split, locks, batch plans)

Samples of the harness (data generation, device touching, format, open, close) are left out; the rest
are shares of the engine's CPU, and are multiplied by the CPU s/GB the bench itself
measured (sequential checkpoints) to give s/GB per stage. Hashing samples perf could not
unwind (BLAKE3's and xxh3's SIMD code) go to stage 1, less the number the bench's own
primitives pass accounts for. Leaf functions worth naming
(crc32c, xxh3, BLAKE3, memcmp, memcpy, page clearing) are counted apart.

Usage (root or perf_event_paranoid <= 1):
  scripts/woj_stages.py [--mib 256] [--compression none] [--configs blake3,woj]
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FREQ = 250  # samples per second per thread

EXCLUDE = re.compile(r"woj_bench::primitives|woj_bench::touch|Volume::format|Volume::open|Volume::close|wait_ready|"
                     r"rand_chacha|Rng::fill|drop_in_place<dedupvol_core::volume::Volume>")
STAGES = [
    ("1 fingerprint", re.compile(r"pipeline::fingerprint")),
    ("2 candidates", re.compile(r"resolve_woj|find_candidates|read_pages")),
    ("3 verify, compress", re.compile(r"verify_and_compress")),
    ("4 place", re.compile(r"place_batch")),
    ("data writes", re.compile(r"write_merged|write_ticketed|hand_off|data::writer")),
    ("journal, flush", re.compile(r"commit_to|Volume::flush|metadata::journal")),
    ("write path, other (request split, locks, batch plans)", re.compile(r"write_blocks|Volume::write")),
    ("harness (transaction buffers)", re.compile(r"run_config")),
]
LEAVES = [
    ("crc32c", re.compile(r"crc32c")),
    ("xxh3", re.compile(r"xxh3")),
    ("BLAKE3", re.compile(r"blake3")),
    ("memcmp", re.compile(r"memcmp|bcmp")),
    ("memcpy/memmove", re.compile(r"memmove|memcpy")),
    ("page faults (kernel page clearing)", re.compile(r"clear_page")),
]


def profile(exe, config, mib, compression, out):
    data = os.path.join(out, f"{config}.perf")
    cmd = ["perf", "record", "-q", "-F", str(FREQ), "--call-graph", "dwarf,16384", "-o", data, "--",
           exe, "bench", "--mode", "woj", "--woj-mib", str(mib), "--woj-configs", config,
           "--compression", compression]
    bench = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    # CPU s/GB of the sequential-checkpoint row.
    cpu = None
    for line in bench.splitlines():
        if line.startswith(f"| {config} |"):
            cpu = float(line.split("|")[5])
            break
    script = subprocess.run(["perf", "script", "-i", data, "-F", "ip,sym"], check=True, capture_output=True,
                            text=True).stdout
    # The bench's own primitives pass hashes the data once with BLAKE3 and once with xxh3,
    # in hand-written SIMD code whose stack perf cannot unwind: those samples are told
    # from the engine's by their expected number (time of the pass x sampling rate).
    mib_per_s = {}
    for line in bench.splitlines():
        m = re.match(r"\| (BLAKE3|xxh3)\S* .* \| (\d+) \|$", line)
        if m:
            mib_per_s[m.group(1)] = float(m.group(2))
    expect = {k: mib * 1.048576 / v * FREQ for k, v in mib_per_s.items() if v > 0}
    stages, leaves, kept, unwound = collections.Counter(), collections.Counter(), 0, collections.Counter()
    for sample in script.split("\n\n"):
        frames = [l.strip() for l in sample.strip().splitlines() if l.strip()]
        if not frames:
            continue
        stack = "\n".join(frames)
        if EXCLUDE.search(stack):
            continue
        leaf = frames[0]
        stage = next((name for name, rx in STAGES if rx.search(stack)), None)
        if stage is None and re.search(r"blake3|xxh3|crc32c", leaf):
            key = "BLAKE3" if "blake3" in leaf else "xxh3" if "xxh3" in leaf else "crc32c"
            unwound[key] += 1
            if unwound[key] <= expect.get(key, 0):
                continue  # counted as the primitives pass
            stage = "1 fingerprint"
        kept += 1
        stages[stage or "other (idle threads, scheduler)"] += 1
        for name, rx in LEAVES:
            if rx.search(leaf):
                leaves[name] += 1
                break
    return cpu, kept, stages, leaves, bench


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exe", default=os.path.join(ROOT, "target/release/dedupvol"))
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--compression", default="none")
    p.add_argument("--configs", default="blake3,woj")
    args = p.parse_args()
    out = tempfile.mkdtemp(prefix="woj-stages-", dir="/tmp")
    results = {}
    try:
        for c in args.configs.split(","):
            results[c] = profile(args.exe, c, args.mib, args.compression, out)
            print(f"woj_stages: {c} profiled", file=sys.stderr, flush=True)
    finally:
        subprocess.run(["rm", "-rf", out])
    configs = list(results)
    print(f"\n{args.mib} MiB, compression {args.compression}; engine CPU s/GB (sequential checkpoints, "
          f"least of 3 runs): " + ", ".join(f"{c} {results[c][0]}" for c in configs) + "\n")
    names = [n for n, _ in STAGES] + ["other (idle threads, scheduler)"]
    table(results, configs, "stage", names, 2)
    print()
    table(results, configs, "leaf function (anywhere)", [n for n, _ in LEAVES], 3)


def table(results, configs, title, names, field):
    """One row per name: its share of each configuration's samples, and those s/GB."""
    print(f"| {title} | " + " | ".join(f"{c}: % of samples | {c}: s/GB" for c in configs) + " |")
    print("|---|" + "---|---|" * len(configs))
    for n in names:
        cells = []
        for c in configs:
            cpu, kept = results[c][0], results[c][1]
            share = results[c][field][n] / kept if kept else 0
            cells += [f"{100 * share:.1f}%", f"{share * cpu:.3f}" if cpu is not None else "-"]
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
