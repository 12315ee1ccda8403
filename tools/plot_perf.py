#!/usr/bin/env python3
"""Latency vs tokens per rank from `elasticep bench --json` sweeps (tools/perf-variants.sh, STEPS=sweep).

    python3 tools/plot_perf.py --out DIR bench_direct_sweep_decode.json bench_direct_sweep_prefill.json ...

One figure per input file (decode: masked layout, graph mode; prefill: contiguous, host sync): the
median isolated latency of dispatch, combine and (when timed) the CUDA-graph replay of both, against
tokens per rank, with the staged-path HBM floor the bench reports. Writes DIR/<input name>.png and
prints one line per point. Needs matplotlib (the GPU machine's image has it).
"""
import argparse
import json
import os
import sys


def points(doc):
    rows = []
    for r in doc.get("results", []):
        ph = r.get("phases", {})

        def med(name):
            x = (ph.get(name) or {}).get("latency_us") or {}
            return x.get("median")

        floor = [(ph.get(n) or {}).get("hbm_floor_us") for n in ("dispatch", "combine")]
        rows.append((r.get("tokens"), med("dispatch"), med("combine"), med("graph"), floor[0], floor[1]))
    return sorted(rows, key=lambda p: p[0])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for the .png files")
    ap.add_argument("inputs", nargs="+", help="elasticep bench --json files")
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(a.out, exist_ok=True)
    for path in a.inputs:
        doc = json.load(open(path))
        pts = points(doc)
        if not pts:
            print(f"{path}: no results", file=sys.stderr)
            continue
        sc = doc.get("scenario", {})
        gpu = doc.get("gpu") or ""
        t = [p[0] for p in pts]
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for i, name in ((1, "dispatch"), (2, "combine"), (3, "graph replay D+C")):
            ys = [p[i] for p in pts]
            if any(y is not None for y in ys):
                ax.plot(t, ys, marker="o", label=name)
        for i, name in ((4, "dispatch floor (staged)"), (5, "combine floor (staged)")):
            ys = [p[i] for p in pts]
            if any(y is not None for y in ys):
                ax.plot(t, ys, linestyle="--", linewidth=1, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("latency, us (median)")
        title = os.path.splitext(os.path.basename(path))[0]
        ax.set_title(f"{title}: {sc.get('ranks', '?')} ranks, {gpu}", fontsize=9)
        ax.grid(True, which="both", linewidth=0.3)
        ax.legend(fontsize=8)
        png = os.path.join(a.out, title + ".png")
        fig.tight_layout()
        fig.savefig(png, dpi=120)
        plt.close(fig)
        for p in pts:
            print(f"{title} T={p[0]}: dispatch {p[1]} us, combine {p[2]} us, graph {p[3]} us")
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
