#!/usr/bin/env python3
"""Per-kernel stage times (ELASTICEP_STAGE_TIMES=1) as one table: for each section of the log
(`### <label>` lines, as tools/device-check STEPS=perf writes them: "new: decode T=128", "base: ..."),
each stage's median over the ranks of their per-rank medians, and the smallest per-rank minimum.
Sections with the same label after "new:" / "base:" are put side by side with the change.

    python3 tools/stage_table.py OUT/stages.log [--json rows.json]

The input lines are the CUDA backend's, printed when a buffer is destroyed:
    [elasticep] stage times rank 4 dispatch plan          median      28.0 us  min      15.4 us  (23 calls)
"""
import argparse
import json
import re
import statistics
import sys

LINE = re.compile(r"\[elasticep\] stage times rank (\d+) (\S+) (.+?)\s+median\s+([0-9.]+) us\s+min\s+([0-9.]+) us")


def parse(text):
    """{section: {(phase, stage): {"medians": [...], "mins": [...]}}}, sections in order of appearance."""
    sections, cur = {}, "(no section)"
    for line in text.splitlines():
        if line.startswith("### "):
            cur = line[4:].strip()
            sections.setdefault(cur, {})
            continue
        m = LINE.search(line)
        if not m:
            continue
        _, phase, stage, med, mn = m.groups()
        entry = sections.setdefault(cur, {}).setdefault((phase, stage.strip()), {"medians": [], "mins": []})
        entry["medians"].append(float(med))
        entry["mins"].append(float(mn))
    return {k: v for k, v in sections.items() if v}


def summarize(sections):
    rows = []
    for sec, stages in sections.items():
        for (phase, stage), e in stages.items():
            rows.append({"section": sec, "phase": phase, "stage": stage, "ranks": len(e["medians"]),
                         "median_us": statistics.median(e["medians"]), "min_us": min(e["mins"])})
    return rows


def pairs(rows):
    """Rows of "new: X" joined with those of "base: X" (same phase and stage): base figures and change."""
    base = {(r["section"][len("base:"):].strip(), r["phase"], r["stage"]): r for r in rows
            if r["section"].startswith("base:")}
    out = []
    for r in rows:
        if r["section"].startswith("base:"):
            continue
        key = (r["section"][len("new:"):].strip() if r["section"].startswith("new:") else r["section"], r["phase"],
               r["stage"])
        b = base.get(key)
        out.append(dict(r, base_median_us=b["median_us"] if b else None, base_min_us=b["min_us"] if b else None,
                        change=(r["median_us"] - b["median_us"]) / b["median_us"] if b and b["median_us"] else None))
    return out


def markdown(rows):
    has_base = any(r["base_median_us"] is not None for r in rows)
    head = ["section", "stage", "ranks", "median us", "min us"] + (["base median", "base min", "change"] if has_base else [])
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [r["section"], "%s %s" % (r["phase"], r["stage"]), str(r["ranks"]), "%.1f" % r["median_us"],
                 "%.1f" % r["min_us"]]
        if has_base:
            b = r["base_median_us"]
            cells += ["-" if b is None else "%.1f" % b, "-" if b is None else "%.1f" % r["base_min_us"],
                      "-" if r["change"] is None else "%+.1f %%" % (100 * r["change"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", help="a log with ELASTICEP_STAGE_TIMES=1 output (stages.log)")
    ap.add_argument("--json", dest="json_out", help="also write the rows as JSON here")
    a = ap.parse_args(argv)
    with open(a.log) as f:
        rows = pairs(summarize(parse(f.read())))
    if not rows:
        sys.exit("stage_table: no stage times in %s" % a.log)
    sys.stdout.write(markdown(rows))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
