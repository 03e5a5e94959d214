#!/usr/bin/env python3
"""Turns the suite's results.json into README.md + SVG charts (standard library only).

usage: bench_report.py RESULTS.json OUTDIR

Every number in the report is read from results.json; a figure that is missing is printed
as "-" and a target that could not be measured is marked "not measured", never "met".
"""

import html
import json
import sys
from pathlib import Path

NBD_JOBS = ["seq-write-1m", "rand-write-4k-qd32", "rand-read-4k-qd32", "sql-mix", "vdi-mix"]
COLORS = ["#4878d0", "#ee854a", "#6acc64", "#d65f5f", "#956cb4", "#8c613c", "#dc7ec0", "#797979",
          "#d5bb67", "#82c6e2", "#1b5e20", "#b71c1c"]


def legend(items, y0, width):
    """Legend entries laid out left to right, wrapping at width; returns SVG elements."""
    out, x, y = [], 20.0, y0
    for i, name in enumerate(items):
        w = 14 + len(name) * 6.4 + 18
        if x + w > width and x > 20:
            x, y = 20.0, y + 16
        out.append(f'<rect x="{x:.0f}" y="{y-9}" width="10" height="10" fill="{COLORS[i % len(COLORS)]}"/>')
        out.append(f'<text x="{x+14:.0f}" y="{y}">{html.escape(name)}</text>')
        x += w
    return out


def f(v, d=0):
    if v is None:
        return "-"
    try:
        return f"{v:,.{d}f}"
    except (TypeError, ValueError):
        return str(v)


def mib(b):
    return None if b is None else b / 1048576.0


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        out.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(out) + "\n"


def bar_chart(path, title, groups, series, values, unit, ref_line=None):
    """Grouped vertical bars: values[g][s]; None is skipped. ref_line: (y, label)."""
    W, H, L, B, T = 760, 360, 70, 80, 40
    vmax = max([v for row in values for v in row if v is not None] + [ref_line[0] if ref_line else 0] + [1e-9]) * 1.12
    pw, ph = W - L - 20, H - T - B
    gw = pw / max(1, len(groups))
    bw = gw * 0.8 / max(1, len(series))
    s = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
         f'<rect width="{W}" height="{H}" fill="white"/>',
         f'<text x="{W/2}" y="20" text-anchor="middle" font-size="14">{html.escape(title)}</text>']
    for i in range(6):
        y = T + ph - ph * i / 5
        s.append(f'<line x1="{L}" y1="{y:.1f}" x2="{W-20}" y2="{y:.1f}" stroke="#ddd"/>')
        s.append(f'<text x="{L-5}" y="{y+4:.1f}" text-anchor="end">{vmax*i/5:.3g}</text>')
    s.append(f'<text x="15" y="{T+ph/2}" transform="rotate(-90 15 {T+ph/2})" text-anchor="middle">{html.escape(unit)}</text>')
    for gi, g in enumerate(groups):
        x0 = L + gi * gw + gw * 0.1
        for si, _ in enumerate(series):
            v = values[gi][si]
            if v is None:
                continue
            h = ph * v / vmax
            x = x0 + si * bw
            s.append(f'<rect x="{x:.1f}" y="{T+ph-h:.1f}" width="{bw*0.92:.1f}" height="{h:.1f}" fill="{COLORS[si % len(COLORS)]}"/>')
            s.append(f'<text x="{x+bw/2:.1f}" y="{T+ph-h-3:.1f}" text-anchor="middle" font-size="9">{v:.3g}</text>')
        s.append(f'<text x="{L+gi*gw+gw/2:.1f}" y="{T+ph+15}" text-anchor="middle">{html.escape(g)}</text>')
    if ref_line:
        y = T + ph - ph * ref_line[0] / vmax
        s.append(f'<line x1="{L}" y1="{y:.1f}" x2="{W-20}" y2="{y:.1f}" stroke="black" stroke-dasharray="5,3"/>')
        s.append(f'<text x="{W-22}" y="{y-4:.1f}" text-anchor="end">{html.escape(ref_line[1])}</text>')
    s += legend(series, H - 35, W)
    s.append("</svg>")
    Path(path).write_text("\n".join(s))


def stacked_chart(path, title, bars, categories, values, unit):
    """Horizontal stacked bars: values[b][c]."""
    W, rowh, L, T = 760, 34, 170, 40
    H = T + rowh * len(bars) + 70
    vmax = max([sum(v for v in row if v) for row in values] + [1e-9]) * 1.05
    pw = W - L - 30
    s = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
         f'<rect width="{W}" height="{H}" fill="white"/>',
         f'<text x="{W/2}" y="20" text-anchor="middle" font-size="14">{html.escape(title)}</text>']
    for bi, b in enumerate(bars):
        y = T + bi * rowh
        x = L
        s.append(f'<text x="{L-6}" y="{y+rowh/2+4}" text-anchor="end">{html.escape(b)}</text>')
        for ci, _ in enumerate(categories):
            v = values[bi][ci] or 0
            w = pw * v / vmax
            if w > 0:
                s.append(f'<rect x="{x:.1f}" y="{y+5}" width="{w:.1f}" height="{rowh-10}" fill="{COLORS[ci % len(COLORS)]}"/>')
            x += w
        s.append(f'<text x="{x+4:.1f}" y="{y+rowh/2+4}">{sum(v or 0 for v in values[bi]):.1f} {html.escape(unit)}</text>')
    s += legend(categories, H - 40, W)
    s.append("</svg>")
    Path(path).write_text("\n".join(s))


def nbd_value(job, name):
    """MB/s for throughput jobs, IOPS for 4 KiB random jobs; reads for read jobs."""
    if job is None:
        return None
    if name == "rand-read-4k-qd32":
        return job["read"]["iops"]
    if name == "rand-write-4k-qd32":
        return job["write"]["iops"]
    if name in ("sql-mix", "vdi-mix"):
        return job["read"]["bw_mb_s"] + job["write"]["bw_mb_s"]
    return job["write"]["bw_mb_s"]


def nbd_unit(name):
    return "IOPS" if "4k" in name else "MB/s"


def main():
    res = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    m = res.get("machine", {})
    cfg = res.get("config", {})
    md = [f"# dedupvol benchmark report — {m.get('date_utc', '?')} ({cfg.get('mode', '?')} mode)\n"]
    md.append(
        f"- machine: {m.get('cpu')}, {m.get('cores')} cores, {m.get('memory')} RAM, {m.get('os')}, Linux {m.get('kernel')}\n"
        f"- dedupvol commit `{m.get('commit')}`{' (working tree had uncommitted changes)' if m.get('dirty') else ''}; "
        f"{m.get('fio')}; nbdkit {m.get('nbdkit')}; {m.get('borg') or 'borg not installed'}; "
        f"{m.get('restic') or 'restic not installed'}; {m.get('qemu_img')}\n"
        f"- load average at start {f(res.get('load_start'), 2)}, at end {f(res.get('load_end'), 2)} "
        f"(this 2-core machine is shared with other builds: a load above ~0.5 means the figures are noisy)\n"
        f"- suite wall time {f(res.get('suite_seconds'))} s; work dir `{res.get('work_dir')}`\n"
        f"- rerun: `{' '.join(res.get('argv', []))}` (via `scripts/bench-suite.sh`); every command it ran is listed at the end.\n"
    )
    md.append(
        "\n\"X% reducible\" data is split evenly between dedup and compression: a dedup share d and a "
        "compression share c with (1 − d)(1 − c) = 1 − X and d = c (90% → 68.4% duplicates, "
        "68.4% compressible), generated by fio (`dedupe_mode=working_set`, `buffer_compress_percentage`, "
        "`refill_buffers`) over NBD and by `dedupvol bench` in-process (seeded, LZ4-calibrated).\n"
    )

    # --- targets ---
    nbd = res.get("nbd", [])
    by = {(e["target"], e["reducible_pct"]): e for e in nbd}

    def ratio_at(pct, job):
        d, b = by.get(("dedupvol", pct)), by.get(("nbdkit", pct))
        if not d or not b:
            return None
        dv, bv = nbd_value(d["jobs"].get(job), job), nbd_value(b["jobs"].get(job), job)
        return dv / bv if dv is not None and bv else None

    ov = (res.get("overhead") or {}).get("scenarios", [{}])[0]
    wa = ov.get("write_amp_ideal")
    rows = []
    for job, tgt in [("seq-write-1m", 1.0), ("rand-write-4k-qd32", 1.0), ("sql-mix", 1.0), ("vdi-mix", 1.0), ("rand-read-4k-qd32", 0.8)]:
        r = ratio_at(90, job)
        what = ("random 4 KiB reads" if "read" in job else
                f"read+write throughput of the {job} (68% reads; beside the write target)" if "mix" in job else
                f"write throughput ({job})")
        rows.append([f"{what}, 90% reducible, async, vs nbdkit file", f">= {tgt}x", f(r, 2) + ("x" if r else ""),
                     "not measured" if r is None else ("met" if r >= tgt else "**not met**")])
    rows.append(["write amplification (device bytes written / ideal unique compressed bytes), random 4 KiB writes, 90% reducible",
                 "<= 1.5", f(wa, 2), "not measured" if wa is None else ("met" if wa <= 1.5 else "**not met**")])
    md.append("\n## Targets\n\n" + table(["target", "goal", "measured", "status"], rows))

    tg = res.get("targets")
    if tg:
        rows = []
        for s in tg["scenarios"]:
            t = s.get("target") or {}
            unit = t.get("unit", "MB/s")
            e = s.get("engine")
            v = None if not e else (e["ops_s"] if unit == "writes/s" else e["mb_s"])
            rows.append([s["name"], unit, f">= {f(t.get('min'))}", f(v), "not measured" if v is None else ("met" if v >= t.get("min", 0) else "**not met**"),
                         f((s.get("stats") or {}).get("reduction_ratio"), 2), f(s.get("write_amp_ideal"), 2), s["description"]])
        md.append("\n## Issue 2 targets: in-process ingest (`dedupvol bench --mode targets`)\n\n" +
                  table(["scenario", "unit", "target", "measured", "status", "reduction", "WA/ideal", "data"], rows))
        bv = [[(s.get("engine") or {}).get("mb_s"), (s.get("no_reduction_volume") or {}).get("mb_s"), (s.get("raw_file") or {}).get("mb_s")]
              for s in tg["scenarios"]]
        bar_chart(out / "inprocess.svg", "In-process write MB/s: engine vs no-reduction volume vs raw pwrite",
                  [s["name"] for s in tg["scenarios"]], ["dedupvol (dedup+LZ4)", "volume, dedup off + no compression", "raw file pwrite"], bv, "MB/s")
        md.append("\n![in-process throughput](inprocess.svg)\n")

    # --- limits ---
    prim = res.get("primitives")
    if prim:
        rows = []
        for key, j in prim.items():
            for s in j["scenarios"]:
                p = s.get("primitives") or {}
                rows.append([key + " (dup %/compressible %)", f(p.get("blake3_mb_s")), f(p.get("lz4_compress_mb_s")), f(p.get("lz4_decompress_mb_s")),
                             f(p.get("zstd1_compress_mb_s")), f((p.get("lz4_size_fraction") or 0) * 100, 0) + "%"])
        md.append("\n## Machine limits\n\nOne core, 4 KiB chunks, MB/s of input:\n\n" +
                  table(["data", "BLAKE3", "LZ4 compress", "LZ4 decompress", "zstd-1 compress", "LZ4 output size"], rows))
        ds = [j.get("disk_seq_write") for j in prim.values() if j.get("disk_seq_write")]
        if ds:
            md.append(f"\nDisk, buffered `pwrite` + `fdatasync` of a temp file: {f(ds[0]['mb_s'])} MB/s ({ds[0]['what']}).\n")
    disk = res.get("disk")
    if disk:
        rows = [[k, f(v["write"]["bw_mb_s"] + v["read"]["bw_mb_s"]), f(v["write"]["iops"] + v["read"]["iops"]),
                 f(v["write"]["clat_mean_us"] + v["read"]["clat_mean_us"], 1)] for k, v in disk.items()]
        md.append("\nDisk via fio (libaio, O_DIRECT, on the work dir's filesystem):\n\n" + table(["job", "MB/s", "IOPS", "mean latency µs"], rows))

    # --- NBD ---
    if nbd:
        levels = sorted({e["reducible_pct"] for e in nbd})
        rows = []
        for pct in levels:
            for job in NBD_JOBS:
                d, b = by.get(("dedupvol", pct)), by.get(("nbdkit", pct))
                dv = nbd_value((d or {}).get("jobs", {}).get(job), job)
                bv = nbd_value((b or {}).get("jobs", {}).get(job), job)
                dl = ((d or {}).get("jobs", {}).get(job) or {})
                lat = None
                if dl:
                    lat = dl["read" if "read" in job else "write"]["clat_mean_us"]
                rows.append([f"{pct}%", job, nbd_unit(job), f(dv), f(bv), f(dv / bv, 2) if dv is not None and bv else "-", f(lat, 0)])
        md.append(f"\n## fio over NBD: dedupvol serve vs nbdkit file (same disk)\n\nRegion {cfg.get('nbd_region')}, "
                  f"timed jobs {cfg.get('runtime_s')} s each, one fio job per run (one NBD connection), in the order listed "
                  "(the sequential write fills the region first; reads hit written data). SQL/VDI: 68% reads, 80% random, "
                  "reads 8K/64K/128K at 50/25/25% (mean 52 KiB), writes 8K/16K/96K at 50/25/25% (mean 32 KiB), QD 32.\n\n" +
                  table(["reducible", "job", "unit", "dedupvol", "nbdkit", "ratio", "dedupvol mean lat µs"], rows))
        vals = [[ratio_at(pct, job) for pct in levels] for job in NBD_JOBS]
        bar_chart(out / "nbd-ratio.svg", "dedupvol / nbdkit-file (same disk), by reducible %", NBD_JOBS,
                  [f"{p}% reducible" for p in levels], vals, "ratio to baseline", ref_line=(1.0, "baseline = 1.0"))
        md.append("\n![NBD ratio to baseline](nbd-ratio.svg)\n")
        rows = []
        for e in nbd:
            st = e.get("stats") or {}
            rows.append([e["target"], f"{e['reducible_pct']}%", f((e.get("peak_rss_kib") or 0) / 1024, 1), f((e.get("rss_kib") or 0) / 1024, 1),
                         f(st.get("reduction_ratio"), 2) if st else (e.get("stats_error", "-")[:60] if e["target"] == "dedupvol" else "-")])
        md.append("\n### Server memory and reduction after the NBD runs\n\n" +
                  table(["server", "reducible", "peak RSS MiB", "RSS at end MiB", "reduction (dedupvol stats)"], rows))

    # --- overhead ---
    if ov.get("io"):
        io = ov["io"]
        ideal = ov.get("ideal_bytes") or 0
        cats = ["data_write", "journal_write", "block_map_write", "refcount_write", "index_write", "superblock_write"]
        reads = ["data_read", "block_map_read", "verify_read"]
        rows = [[c, f(mib(io.get(c)), 1), f(io.get(c, 0) / ideal, 3) if ideal else "-"] for c in cats + reads]
        rows.append(["**total written**", f(mib(sum(io.get(c, 0) for c in cats)), 1), f(ov.get("write_amp_ideal"), 3)])
        rows.append(["ideal (unique chunks at compressed size)", f(mib(ideal), 1), "1.000"])
        md.append(f"\n## I/O overhead breakdown: random 4 KiB writes, 90% reducible\n\n{ov.get('description')}\n\n"
                  "Bytes moved during the timed phase by category (from `stats.io`), against the ideal: the unique chunks' "
                  "compressed bytes, computed by the estimator on the very same bytes.\n\n" +
                  table(["category", "MiB", "× ideal"], rows))
        stacked_chart(out / "overhead.svg", "Device bytes per category vs ideal (random 4 KiB writes, 90% reducible)",
                      ["ideal", "dedupvol written", "dedupvol read"], ["ideal", *cats, *reads],
                      [[mib(ideal)] + [0] * (len(cats) + len(reads)),
                       [0] + [mib(io.get(c, 0)) for c in cats] + [0] * len(reads),
                       [0] * (1 + len(cats)) + [mib(io.get(c, 0)) for c in reads]], "MiB")
        md.append("\n![overhead](overhead.svg)\n")
        e = ov.get("engine") or {}
        md.append(f"\nIn-process rate of these overwrites: {f(e.get('ops_s'))} writes/s "
                  f"(no-reduction volume {f((ov.get('no_reduction_volume') or {}).get('ops_s'))}, raw pwrite {f((ov.get('raw_file') or {}).get('ops_s'))}).\n")
        sq = ((res.get("overhead_seq") or {}).get("scenarios") or [{}])[0]
        if sq.get("io"):
            md.append(f"\nSequential writes of the same kind of data ({sq.get('description')}): write amplification "
                      f"{f(sq.get('write_amp_ideal'), 3)} × ideal, {f(sq.get('write_amp_logical'), 3)} × logical; "
                      f"{f((sq.get('engine') or {}).get('mb_s'))} MB/s vs no-reduction volume {f((sq.get('no_reduction_volume') or {}).get('mb_s'))} MB/s.\n")

    # --- ingest ---
    ing = res.get("ingest") or []
    for k, d in enumerate(ing):
        rows = []
        for tool, t in d["tools"].items():
            if "error" in t:
                rows.append([tool, "error", "-", "-", "-", str(t["error"])[:120]])
            else:
                rows.append([tool, f(t["ratio"], 2), f(mib(t["stored_bytes"]), 0), f(t["mb_s"]), f(t["seconds"], 1), ""])
        est = d.get("estimate") or {}
        md.append(f"\n## Ingest: {d['dataset']}\n\n{f(mib(d['input_bytes']), 0)} MiB in {len(d['files'])} file(s). "
                  "Ratio = input bytes / bytes stored (dedupvol: physical data bytes in use; others: repository or image size on disk).\n\n" +
                  table(["tool", "ratio", "stored MiB", "MB/s", "seconds", "note"], rows))
        if est:
            md.append(f"\n`dedupvol estimate` predicted {f(est.get('total_reduction_ratio'), 2)}x on the same files "
                      f"(zero {f(mib(est.get('savings_zero_bytes')), 0)} MiB, dedup {f(mib(est.get('savings_dedup_bytes')), 0)} MiB, "
                      f"compression net {f(mib(est.get('savings_compression_bytes')), 0)} MiB saved).\n")
        ebc = d.get("estimate_by_chunk") or {}
        if ebc:
            rows = []
            for cs, e in ebc.items():
                if "error" in e:
                    rows.append([cs, "error", "-", "-", "-", "-"])
                    continue
                n = d["input_bytes"] or 1
                rows.append([cs, f(e["total_reduction_ratio"], 2), f(e["savings_zero_bytes"] * 100 / n, 1) + "%",
                             f(e["savings_dedup_bytes"] * 100 / n, 1) + "%", f(e["compression_gross_bytes"] * 100 / n, 1) + "%",
                             f(e["savings_compression_bytes"] * 100 / n, 1) + "%"])
            md.append("\n`dedupvol estimate` by chunk size (savings as % of the input; LZ4 before and after the engine's packing):\n\n" +
                      table(["chunk", "ratio", "zero", "dedup", "LZ4 gross", "compression net"], rows))
        tools = [t for t in d["tools"] if "error" not in d["tools"][t]]
        if tools:
            bar_chart(out / f"ingest-{k}.svg", f"Ingest: {d['dataset'][:70]}", tools, ["reduction ratio"],
                      [[d["tools"][t]["ratio"]] for t in tools], "input / stored")
            bar_chart(out / f"ingest-{k}-speed.svg", f"Ingest speed: {d['dataset'][:60]}", tools, ["MB/s"],
                      [[d["tools"][t]["mb_s"]] for t in tools], "MB/s")
            md.append(f"\n![ingest ratio](ingest-{k}.svg)\n![ingest speed](ingest-{k}-speed.svg)\n")
    for key in ("ingest_error",):
        if res.get(key):
            md.append(f"\n**{key}**: {res[key]}\n")

    md.append("\n## Exact commands\n\n```\n" + "\n".join(res.get("commands", [])) + "\n```\n")
    (out / "README.md").write_text("".join(md))
    print(out / "README.md")


if __name__ == "__main__":
    main()
