#!/usr/bin/env python3
"""Summarise interleaved `dedupvol bench --mode targets` runs side by side.

    scripts/ab_targets.py OUTDIR

OUTDIR holds files named {base,new}-runN.txt (written by scripts/ab-targets.sh). For
every scenario it prints the engine figure of each run in run order, then the range of
the no-reduction volume over all runs, and the disk figure of every run.
"""
import re
import sys
from pathlib import Path

RUN_NAME = re.compile(r"^(base|new)-run(\d+)\.txt$")


def parse(path):
    """Return (rows, disk) of one bench output: rows maps scenario -> {column: text}."""
    rows = {}
    disk = None
    header = None
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("disk:"):
            disk = line.split()[-1]
            continue
        if line.startswith("scenario") and "engine" in line:
            # Header cells are separated by two or more spaces; one space is inside a name
            # ("limit model", "no-reduction vol").
            header = re.split(r"\s{2,}", line.strip())
            continue
        if header is None or not line.strip() or line.startswith("-"):
            continue
        if line.startswith(("limit model", " ", "[")):
            header = None  # the table ended
            continue
        toks = line.split()
        # The target cell is ">= N": two tokens, one column.
        merged = []
        i = 0
        while i < len(toks):
            if toks[i] in (">=", "<=", ">", "<") and i + 1 < len(toks):
                merged.append(toks[i] + " " + toks[i + 1])
                i += 2
            else:
                merged.append(toks[i])
                i += 1
        if len(merged) != len(header):
            print(f"warning: {path.name}: cannot split row ({len(merged)} cells, "
                  f"{len(header)} columns): {line!r}", file=sys.stderr)
            continue
        rows[merged[0]] = dict(zip(header, merged))
    return rows, disk


def num(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: ab_targets.py OUTDIR")
    outdir = Path(sys.argv[1])
    runs = []
    for p in outdir.iterdir():
        m = RUN_NAME.match(p.name)
        if m:
            runs.append((int(m.group(2)), 0 if m.group(1) == "base" else 1, m.group(1), p))
    if not runs:
        sys.exit(f"ab_targets.py: no base-runN.txt/new-runN.txt in {outdir}")
    runs.sort()  # run order: base 1, new 1, base 2, new 2, ...
    labels = [f"{name} {n}" for n, _, name, _ in runs]
    parsed = [parse(p) for _, _, _, p in runs]

    scenarios = []
    for rows, _ in parsed:
        for s in rows:
            if s not in scenarios:
                scenarios.append(s)

    cols = ["scenario", "unit", "target"] + labels + ["no-red. vol range", "base mean", "new mean", "new/base"]
    table = []
    for s in scenarios:
        cells = [s, "", ""]
        engines = {"base": [], "new": []}
        nored = []
        for (n, _, name, _), (rows, _) in zip(runs, parsed):
            r = rows.get(s)
            if r is None:
                cells.append("-")
                continue
            cells[1] = r.get("unit", "")
            cells[2] = r.get("target", "")
            cells.append(r.get("engine", "?"))
            v = num(r.get("engine"))
            if v is not None:
                engines[name].append(v)
            v = num(r.get("no-reduction vol"))
            if v is not None:
                nored.append(v)
        cells.append(f"{min(nored):.0f}-{max(nored):.0f}" if nored else "-")
        means = {k: (sum(v) / len(v) if v else None) for k, v in engines.items()}
        cells.append(f"{means['base']:.0f}" if means["base"] is not None else "-")
        cells.append(f"{means['new']:.0f}" if means["new"] is not None else "-")
        if means["base"] and means["new"] is not None:
            cells.append(f"{means['new'] / means['base']:.3f}")
        else:
            cells.append("-")
        table.append(cells)
    disk_cells = ["disk (1 MiB writes + fdatasync)", "MB/s", ""] + [d or "-" for _, d in parsed]
    disk_cells += [""] * (len(cols) - len(disk_cells))
    table.append(disk_cells)

    widths = [max(len(str(row[i])) for row in [cols] + table) for i in range(len(cols))]
    fmt = lambda row: "  ".join(
        str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
    print(fmt(cols))
    print("-" * len(fmt(cols)))
    for row in table:
        print(fmt(row))
    print()
    for (n, _, name, p) in runs:
        print(f"{name} {n}: {p}")


if __name__ == "__main__":
    main()
