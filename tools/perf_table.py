#!/usr/bin/env python3
"""Issue 15's table (docs/PERFORMANCE.md): `elasticep bench --json` results against their HBM floors
and the targets, optionally beside a base build's results (an A/B in one run) and the torch emulation.

    python3 tools/perf_table.py --decode decode.json --prefill prefill.json \\
        [--base-decode old_decode.json --base-prefill old_prefill.json] [--emulation emulation.json]

decode.json: a decode bench (masked layout, --graph) with a row of --decode-tokens tokens per rank
(default 128); prefill.json: a prefill bench (contiguous, host sync) with a row of --prefill-tokens
(default 4096). Latencies are the bench's medians (isolated: slowest rank per round; b2b: back to
back). Two floors per phase, both from the bench's own byte count (include/elasticep/traffic.hpp):
"floor" (hbm_floor_us: the staged data flow, every message and partial written and read once; the
one issue 15's targets use) and "min" (hbm_min_floor_us: every row written once into its final
place, the least any implementation moves). --info takes `elasticep info --json` of the memory
target's shape (EP128, C = 8192: `--ranks 128 --tokens 8192 --alignment 128 --backend cuda`): its
host-sync reservation against the 4 GiB target, and beside it what the buffer-owned contiguous
outputs add (their worst case, M_cap rows). Where the bench measured it (ranks on one clock), the isolated
figures also show the ranks' start spread (the last rank's start minus the first's) and the time from
the last rank's start to the last end, medians over the rounds. Prints a Markdown table; --json FILE writes the same
figures as JSON. Exit status 0 whether or not a target is met (the table says which).
"""
import argparse
import json
import sys

# Issue 15's targets (8 ranks on one H200, DeepSeek-V3 shapes): ratio to the staged floor, or microseconds.
TARGETS = {
    ("decode", "dispatch"): ("ratio", 2.0),
    ("decode", "combine"): ("ratio", 1.5),
    ("decode", "graph"): ("us", 150.0),
    ("decode", "graph b2b"): ("us", 150.0),
    ("prefill", "dispatch"): ("ratio", 1.2),
    ("prefill", "combine"): ("ratio", 1.1),
}
TARGET_SHAPE = {"hidden": 7168, "experts": 256, "topk": 8, "ranks": 8, "payload": "fp8"}
RESERVATION_TARGET_GIB = 4.0  # per rank, host-sync prefill, EP128, C = 8192, H = 7168 fp8
GIB = float(1 << 30)


def load(path):
    if not path:
        return None
    with open(path) as f:
        return json.load(f)


def row_of(doc, tokens):
    """The result row of `tokens` tokens per rank (None when absent)."""
    for r in (doc or {}).get("results", []):
        if r.get("tokens") == tokens:
            return r
    return None


def figures(doc, tokens, phase):
    """[(name, measured us, staged floor us, min floor us)] of one phase's row."""
    r = row_of(doc, tokens)
    if r is None:
        return []
    ph = r.get("phases", {})

    def med(name, key="latency_us"):
        t = (ph.get(name) or {}).get(key) or {}
        return t.get("median")

    def floors(name):
        p = ph.get(name) or {}
        return p.get("hbm_floor_us"), p.get("hbm_min_floor_us")

    def spread(name, key="latency_us"):  # the ranks' start spread and the time from the last start
        t = (ph.get(name) or {}).get(key) or {}
        return t.get("start_spread"), t.get("from_last_start")

    out = []
    for name in ("dispatch", "combine"):
        out.append((name, med(name)) + floors(name) + spread(name))
    if phase == "decode" and ph.get("graph"):
        out.append(("graph", med("graph")) + floors("graph") + spread("graph"))
        out.append(("graph b2b", med("graph", "back_to_back_us")) + floors("graph") + (None, None))
    return out


def emulation_us(doc, phase, name):
    for p in (doc or {}).get("phases", []):
        if p.get("phase") == phase and name in ("dispatch", "combine"):
            return (p.get(name) or {}).get("median_us")
    return None


def verdict(phase, name, us, floor):
    kind, limit = TARGETS.get((phase, name), (None, None))
    if kind is None or us is None:
        return "", None
    if kind == "us":
        return "<= %g us" % limit, us <= limit
    if not floor:
        return "<= %gx floor" % limit, None
    return "<= %gx floor" % limit, us / floor <= limit


def shape_note(doc, phase):
    s = (doc or {}).get("scenario", {})
    off = ["%s %s (targets: %s)" % (k, s.get(k), v) for k, v in TARGET_SHAPE.items() if s.get(k) != v]
    where = "%s backend%s" % ((doc or {}).get("backend", "?"), ", " + doc["gpu"] if (doc or {}).get("gpu") else "")
    return "%s: %s, %s ranks, H %s, E %s, K %s, %s%s" % (
        phase, where, s.get("ranks"), s.get("hidden"), s.get("experts"), s.get("topk"), s.get("payload"),
        ("; differs from the targets' shape: " + ", ".join(off)) if off else "")


def fmt(v, unit=""):
    if v is None:
        return "-"
    return ("%.0f" % v if abs(v) >= 100 else "%.1f" % v) + unit


def ratio(v):
    return "-" if v is None else "%.2fx" % v


def build(args):
    docs = {"decode": load(args.decode), "prefill": load(args.prefill)}
    base = {"decode": load(args.base_decode), "prefill": load(args.base_prefill)}
    emu = load(args.emulation)
    tokens = {"decode": args.decode_tokens, "prefill": args.prefill_tokens}
    rows = []
    for phase in ("decode", "prefill"):
        if docs[phase] is None:
            continue
        base_fig = {f[0]: f[1] for f in figures(base[phase], tokens[phase], phase)}
        for name, us, floor, min_floor, spread, from_last in figures(docs[phase], tokens[phase], phase):
            target, met = verdict(phase, name, us, floor)
            b = base_fig.get(name)
            rows.append({
                "phase": phase, "tokens": tokens[phase], "figure": name, "us": us, "floor_us": floor,
                "x_floor": us / floor if us and floor else None, "min_floor_us": min_floor,
                "x_min_floor": us / min_floor if us and min_floor else None, "target": target, "met": met,
                "base_us": b, "change": (us - b) / b if us is not None and b else None,
                "emulation_us": emulation_us(emu, phase, name),
                "start_spread_us": spread, "from_last_start_us": from_last,
            })
    return docs, base, rows


def memory_rows(info):
    """The reservation target's figures from `elasticep info --json` (None without it)."""
    if not info:
        return []
    c = info.get("config") or {}
    res = (c.get("cuda_reservation") or {}).get("staged_host_sync_bytes")
    outs = ((c.get("layouts") or {}).get("contiguous") or {}).get("total_bytes")
    shape = "EP%s, C = %s, H = %s %s" % (c.get("ranks"), c.get("max_tokens_per_rank"), c.get("hidden"), c.get("payload"))
    out = []
    if res is not None:
        out.append({"figure": "reservation, host-sync prefill", "shape": shape, "gib": res / GIB,
                    "target": "<= %g GiB" % RESERVATION_TARGET_GIB, "met": res / GIB <= RESERVATION_TARGET_GIB})
    if outs is not None:
        out.append({"figure": "+ buffer-owned contiguous outputs (worst case, M_cap rows)", "shape": shape,
                    "gib": outs / GIB, "target": "-", "met": None})
    return out


def markdown(docs, base, rows, mem=()):
    has_base = any(r["base_us"] is not None for r in rows)
    has_emu = any(r["emulation_us"] is not None for r in rows)
    has_spread = any(r.get("start_spread_us") is not None for r in rows)
    head = ["phase", "figure", "measured", "floor", "x floor", "min floor", "x min", "target", "met"]
    if has_base:
        head += ["base", "change"]
    if has_emu:
        head += ["torch emulation"]
    if has_spread:
        head += ["start spread", "from last start"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        met = "" if r["met"] is None else ("yes" if r["met"] else "**no**")
        cells = ["%s T=%d" % (r["phase"], r["tokens"]), r["figure"], fmt(r["us"], " us"), fmt(r["floor_us"], " us"),
                 ratio(r["x_floor"]), fmt(r["min_floor_us"], " us"), ratio(r["x_min_floor"]), r["target"] or "-",
                 met or "-"]
        if has_base:
            cells += [fmt(r["base_us"], " us"), "-" if r["change"] is None else "%+.1f %%" % (100 * r["change"])]
        if has_emu:
            cells += [fmt(r["emulation_us"], " us")]
        if has_spread:
            cells += [fmt(r.get("start_spread_us"), " us"), fmt(r.get("from_last_start_us"), " us")]
        lines.append("| " + " | ".join(cells) + " |")
    if mem:
        lines += ["", "| memory (per rank) | shape | GiB | target | met |", "| --- | --- | --- | --- | --- |"]
        for m in mem:
            met = "-" if m["met"] is None else ("yes" if m["met"] else "**no**")
            lines.append("| %s | %s | %.2f | %s | %s |" % (m["figure"], m["shape"], m["gib"], m["target"], met))
    notes = [shape_note(d, p) for p, d in docs.items() if d is not None]
    notes += ["base " + shape_note(d, p) for p, d in base.items() if d is not None]
    return "\n".join(lines + [""] + ["- " + n for n in notes]) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode", help="elasticep bench --json of the decode run")
    ap.add_argument("--prefill", help="elasticep bench --json of the prefill run")
    ap.add_argument("--base-decode", help="the same decode bench of a base build (A/B)")
    ap.add_argument("--base-prefill", help="the same prefill bench of a base build (A/B)")
    ap.add_argument("--emulation", help="bench/torch_emulation.py --json of the same machine")
    ap.add_argument("--info", help="elasticep info --json of the memory target's shape")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--json", dest="json_out", help="also write the rows as JSON here")
    a = ap.parse_args(argv)
    if not a.decode and not a.prefill:
        ap.error("give --decode and/or --prefill")
    docs, base, rows = build(a)
    mem = memory_rows(load(a.info))
    for phase, doc in docs.items():
        if doc is not None and not any(r["phase"] == phase for r in rows):
            sys.exit("perf_table: %s has no row of %d tokens per rank" %
                     (getattr(a, phase), a.decode_tokens if phase == "decode" else a.prefill_tokens))
    sys.stdout.write(markdown(docs, base, rows, mem))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"rows": rows, "memory": mem}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
