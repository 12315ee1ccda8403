#!/usr/bin/env python3
"""An A/B of repeated runs (tools/device-check STEPS=perf with PERF_REPEATS=N): the decode headline
run N times by each build (or setting), alternating new and base, so that a drift of the machine
during the step falls on both alike. For each figure (dispatch, combine, and with --graph the graph
replay and its back-to-back form) it shows every repeat's median latency, new and base, the median
over the repeats of each, and the paired change: the median over the repeats of (new - base) of the
same repeat. Read a change as real only where it exceeds the spread of the repeats themselves.

    python3 tools/ab_repeats.py --tokens 128 --new perf_decode_rep1.json ... --base base_perf_decode_rep1.json ...

Prints a Markdown table; --json FILE writes the same figures. Exit status 0 whatever the figures are.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from perf_table import figures, fmt, load  # noqa: E402


def medians(paths, tokens):
    """{figure: [median us of each run]} over the runs of `paths` (None where a run lacks a figure)."""
    out = {}
    for i, path in enumerate(paths):
        for name, us, *_ in figures(load(path), tokens, "decode"):
            out.setdefault(name, [None] * len(paths))[i] = us
    return out


def summarize(new, base):
    """Rows of (figure, new runs, base runs, new median, base median, paired change)."""
    rows = []
    for name, runs in new.items():
        b = base.get(name, [])
        pairs = [n - o for n, o in zip(runs, b) if n is not None and o is not None]
        rows.append({
            "figure": name,
            "new_us": runs,
            "base_us": b,
            "new_median_us": median_of(runs),
            "base_median_us": median_of(b),
            "paired_change_us": median_of(pairs),
        })
    return rows


def median_of(values):
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def markdown(rows, tokens):
    def runs(v):
        return " / ".join(fmt(x) for x in v) if v else "-"

    out = ["| decode T=%d | new, each repeat | base, each repeat | new median | base median | paired change |" % tokens,
           "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ch = r["paired_change_us"]
        out.append("| %s | %s | %s | %s | %s | %s |" %
                   (r["figure"], runs(r["new_us"]), runs(r["base_us"]), fmt(r["new_median_us"], " us"),
                    fmt(r["base_median_us"], " us"), "-" if ch is None else "%+.1f us" % ch))
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128, help="the row of this many tokens per rank")
    ap.add_argument("--new", nargs="+", required=True, help="the new build's repeats (bench --json each)")
    ap.add_argument("--base", nargs="+", required=True, help="the base's repeats, in the same order")
    ap.add_argument("--json", dest="json_out", help="also write the rows as JSON here")
    a = ap.parse_args(argv)
    if len(a.new) != len(a.base):
        ap.error("give as many --base runs as --new runs (%d and %d)" % (len(a.base), len(a.new)))
    rows = summarize(medians(a.new, a.tokens), medians(a.base, a.tokens))
    if not rows:
        sys.exit("ab_repeats: no run has a row of %d tokens per rank" % a.tokens)
    sys.stdout.write(markdown(rows, a.tokens))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"tokens": a.tokens, "repeats": len(a.new), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
