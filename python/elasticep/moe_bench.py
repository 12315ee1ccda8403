"""``python -m elasticep.bench --moe-layer [--deepgemm]``: a whole MoE layer, timed per stage.

Per rank (ranks are threads of this process, one ThreadGroup; on a GPU all on GPU 0, each with its own
CUDA stream) and round: dispatch (:class:`elasticep.serving.MoeDispatcher`, the phase's layout) ->
the routed experts -> combine. Two expert paths:

- ``reference``: :class:`elasticep.serving.ReferenceMoeLayer` (cuBLASLt on a GPU, plain loops on the
  CPU), one stage ``experts``;
- ``deepgemm`` (``--deepgemm``, Hopper GPU with ``deep_gemm`` importable):
  :class:`elasticep.integrations.deepgemm.DeepGemmExperts` on the same weights, stages ``gate_up``
  (DeepGEMM), ``act_quant`` (SiLU * up, FP8 1x128 requantization), ``down`` (DeepGEMM). With
  ``--deepgemm`` both paths run (``--no-reference`` skips the reference one).

A stage's time per round is the slowest rank's (CUDA events on a GPU, the host clock on the CPU);
the report gives each stage's median/min/max over the rounds, its share, and the communication share
(dispatch + combine). Both paths see the same inputs; the report gives their agreement on the last
round (RMS of the difference over RMS of the reference output, per rank, the largest). Correctness
against the dense reference is the tests' job (tests/python/test_deepgemm.py, test_serving_gpu.py).

Defaults: on a GPU DeepSeek-V3's layer (H = 7168, I = 2048, E = 256, K = 8) on 8 ranks x 128 tokens,
prefill; on the CPU H = 1024, I = 256, E = 16, K = 4 on 2 ranks x 8 tokens. Route weights are the
bench's routing weights times ``--routed-scaling`` (DeepSeek-V3: 2.5). Decode with ``--deepgemm``
rounds the capacity up so that ranks x capacity is a multiple of 128 (DeepGEMM's masked kernel
stores whole row blocks).

Example::

    python -m elasticep.bench --moe-layer --deepgemm --json moe.json
    python -m elasticep.bench --moe-layer --deepgemm --phase decode
    python -m elasticep.bench --moe-layer --backend cpu --json -
"""

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time

_TOOL = "python -m elasticep.bench --moe-layer"
_DSV3 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _UsageError(message)


def _parse(argv):
    p = _Parser(prog=_TOOL, description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--moe-layer", action="store_true", help=argparse.SUPPRESS)  # the selector bench.py hands over
    a("--deepgemm", action="store_true", help="also run the experts on DeepGEMM's grouped GEMMs (Hopper GPU)")
    a("--no-reference", dest="reference", action="store_false", help="with --deepgemm: skip the reference path")
    a("--phase", choices=["prefill", "decode"], default="prefill")
    a("--ranks", "-r", type=int, default=None, help="ranks (threads) [GPU 8, CPU 2]")
    a("--tokens", "-t", type=int, default=None, help="tokens per rank [GPU 128, CPU 8]")
    a("--max-tokens-per-rank", "--capacity", dest="capacity", type=int, default=0, help="buffer capacity (0: tokens)")
    a("--hidden", type=int, default=None, help="H [GPU 7168, CPU 1024]")
    a("--intermediate", type=int, default=None, help="I [GPU 2048, CPU 256]")
    a("--experts", "-e", type=int, default=None, help="E [GPU 256, CPU 16]")
    a("--topk", "-k", type=int, default=None, help="K [GPU 8, CPU 4]")
    a("--quant-config", choices=["fp8", "none"], default="fp8", help="fp8: DeepSeek-V3's block FP8; none: bf16")
    a("--routed-scaling", type=float, default=2.5)
    a("--skew", type=float, default=0.8)
    a("--rounds", "-n", type=int, default=5)
    a("--warmup", "-w", type=int, default=1)
    a("--seed", type=int, default=1)
    a("--backend", choices=["auto", "cpu", "cuda"], default="auto")
    a("--timeout", type=float, default=600.0, help="seconds any wait on a peer may take (DeepGEMM JIT compiles)")
    a("--json", nargs="?", const="-", default=None, metavar="FILE",
      help="the report as JSON on stdout instead of the table; with FILE, into FILE (the table on stdout)")
    args = p.parse_args(argv)
    return args


def _defaults(args, gpu):
    d = dict(ranks=8, tokens=128, hidden=7168, intermediate=2048, experts=256, topk=8) if gpu else \
        dict(ranks=2, tokens=8, hidden=1024, intermediate=256, experts=16, topk=4)
    for k, v in d.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for name, lo in (("ranks", 1), ("tokens", 0), ("hidden", 128), ("intermediate", 128), ("experts", 1), ("topk", 1),
                     ("rounds", 1), ("warmup", 0)):
        if getattr(args, name) < lo:
            raise _UsageError("--%s must be >= %d, got %d" % (name, lo, getattr(args, name)))
    if args.hidden % 128 or args.intermediate % 128:
        raise _UsageError("--hidden %d and --intermediate %d must be multiples of 128 (the FP8 blocks)"
                          % (args.hidden, args.intermediate))
    if args.experts % args.ranks:
        raise _UsageError("--experts %d is not a multiple of --ranks %d" % (args.experts, args.ranks))
    if args.topk > args.experts:
        raise _UsageError("--topk %d exceeds --experts %d" % (args.topk, args.experts))
    if args.capacity and args.capacity < args.tokens:
        raise _UsageError("--max-tokens-per-rank %d is below --tokens %d" % (args.capacity, args.tokens))
    cap = args.capacity or max(args.tokens, 1)
    if args.deepgemm and args.phase == "decode":
        step = 128 // math.gcd(args.ranks, 128)
        cap = (cap + step - 1) // step * step
    args.capacity = cap


# ---- inputs -------------------------------------------------------------------------------------


def _rank_inputs(args, rank):
    """(x bf16 bits [T, H], topk_idx int64 [T, K], weights fp32 [T, K]) of one rank, numpy, seeded."""
    import numpy as np

    from . import _routing

    idx, w = _routing.make_routing(rank, args.tokens, args.experts, args.topk, skew=args.skew, seed=args.seed)
    w = (w * np.float32(args.routed_scaling)).astype(np.float32)
    rng = np.random.default_rng(args.seed * 1000 + rank)
    x = rng.uniform(-1, 1, (args.tokens, args.hidden)).astype(np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    xb = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return xb, idx, w


class _Clock:
    """Stage marks: CUDA events on a stream, or the host clock."""

    def __init__(self, torch, stream):
        self.torch, self.stream, self.marks = torch, stream, []

    def reset(self):
        self.marks = []

    def mark(self, name):
        if self.stream is not None:
            ev = self.torch.cuda.Event(enable_timing=True)
            ev.record(self.stream)
            self.marks.append((name, ev))
        else:
            self.marks.append((name, time.perf_counter()))

    def stages_us(self):
        """{stage: us} from consecutive marks (the first mark is the start)."""
        out = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            out[name] = a.elapsed_time(b) * 1e3 if self.stream is not None else (b - a) * 1e6
        return out


# ---- one path -----------------------------------------------------------------------------------


def _run_path(args, backend, path, shared):
    """Runs ``path`` ("reference" or "deepgemm") on all ranks; returns per-rank stage lists and outputs."""
    import numpy as np

    import elasticep as ep
    from . import serving as S

    nr = args.ranks
    el = args.experts // nr
    groups = ep.ThreadGroup(nr, timeout=args.timeout)
    barrier = threading.Barrier(nr)
    recs = [None] * nr
    errors = [None] * nr
    torch = shared.get("torch")
    cuda = backend == "cuda"
    quant = _DSV3 if args.quant_config == "fp8" else None
    kind = "fp8_block128" if quant else "bf16"

    def rank_main(r):
        try:
            stream = torch.cuda.Stream() if cuda else None
            ctx = torch.cuda.stream(stream) if cuda else _Null()
            with ctx:
                w = shared["weights"][r]
                if w is None:
                    w = S.synthetic_expert_weights(kind, el, args.hidden, args.intermediate, first_expert=r * el,
                                                   seed=args.seed, like=torch.device("cuda") if cuda else None)
                    shared["weights"][r] = w
                if path == "deepgemm":
                    from .integrations.deepgemm import DeepGemmExperts

                    experts = DeepGemmExperts(w["gate_up"], w["gate_up_scales"], w["down"], w["down_scales"])
                    alignment = experts.alignment
                    note = "DeepGEMM m_grouped_fp8_gemm_nt_%s" % ("masked" if args.phase == "decode" else "contiguous")
                else:
                    experts = S.ReferenceMoeLayer(w["gate_up"], w["down"], gate_up_scales=w.get("gate_up_scales"),
                                                  down_scales=w.get("down_scales"))
                    alignment = 128
                    note = "%s: %s" % (experts.path, experts.path_note)
                buf = S.serving_buffer(groups[r], args.experts, args.topk, args.hidden, args.capacity, quant=quant,
                                       backend=backend, cached=False, timeout=args.timeout)
                disp = S.MoeDispatcher(buf, expert_alignment=alignment)
                x, idx, wt = _rank_inputs(args, r)
                if cuda:
                    x = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda()
                    idx, wt = torch.from_numpy(idx).cuda(), torch.from_numpy(wt).cuda()
                clock = _Clock(torch, stream)
                stages = []
                out = None
                for i in range(args.warmup + args.rounds):
                    if cuda:
                        stream.synchronize()
                    barrier.wait()
                    clock.reset()
                    clock.mark("start")
                    d = disp.dispatch(x, idx, wt, phase=args.phase)
                    clock.mark("dispatch")
                    if path == "deepgemm":
                        y = experts.forward(d, marks=clock.mark)
                    else:
                        y = experts(d)
                        clock.mark("experts")
                    out = disp.combine(y)
                    clock.mark("combine")
                    if cuda:
                        stream.synchronize()
                    if i >= args.warmup:
                        stages.append(clock.stages_us())
                if cuda:
                    out = out.cpu().view(torch.int16).numpy().view(np.uint16)
                recs[r] = dict(stages=stages, out=np.array(out, copy=True), note=note)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors[r] = e
            try:
                barrier.abort()
            except Exception:  # noqa: BLE001
                pass

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(nr)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [(r, e) for r, e in enumerate(errors) if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    failed = failed or [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        r, e = failed[0]
        raise RuntimeError("%s path, rank %d: %s: %s" % (path, r, type(e).__name__, e)) from e
    return recs


def _summarise(path, recs):
    """Per stage: the slowest rank per round, then median/min/max over rounds."""
    names = list(recs[0]["stages"][0].keys()) if recs[0]["stages"] else []
    rounds = len(recs[0]["stages"])
    stages = {}
    for n in names:
        per_round = [max(rec["stages"][i][n] for rec in recs) for i in range(rounds)]
        stages[n] = dict(median_us=statistics.median(per_round), min_us=min(per_round), max_us=max(per_round))
    total = sum(s["median_us"] for s in stages.values())
    for s in stages.values():
        s["share"] = s["median_us"] / total if total > 0 else 0.0
    comm = sum(stages[n]["median_us"] for n in ("dispatch", "combine") if n in stages)
    return dict(path=path, gemm=recs[0]["note"], stages=stages, total_us=total,
                communication_share=comm / total if total > 0 else 0.0)


def _agreement(ref_recs, dg_recs):
    import numpy as np

    worst = 0.0
    for a, b in zip(ref_recs, dg_recs):
        fa = (a["out"].astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        fb = (b["out"].astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        if fa.size == 0:
            continue
        denom = math.sqrt(float(np.mean(fa * fa))) or 1.0
        worst = max(worst, math.sqrt(float(np.mean((fa - fb) ** 2))) / denom)
    return dict(metric="max over ranks of RMS(deepgemm - reference) / RMS(reference), last round", value=worst)


def _table(report):
    sc = report["scenario"]
    lines = ["%s: %s, %d ranks x %d tokens, H=%d I=%d E=%d K=%d, %s experts, capacity %d (%s backend)" % (
        _TOOL, sc["phase"], sc["ranks"], sc["tokens"], sc["hidden"], sc["intermediate"], sc["experts"], sc["topk"],
        sc["quant"], sc["capacity"], report["backend"])]
    for p in report["paths"]:
        lines.append("  %s  (%s)" % (p["path"], p["gemm"]))
        for n, s in p["stages"].items():
            lines.append("    %-10s median %10.1f us  (min %10.1f, max %10.1f)  %5.1f%%" % (
                n, s["median_us"], s["min_us"], s["max_us"], 100 * s["share"]))
        lines.append("    total      %10.1f us; communication (dispatch + combine) %.1f%%"
                     % (p["total_us"], 100 * p["communication_share"]))
    if report.get("agreement"):
        lines.append("  agreement: %.3g (%s)" % (report["agreement"]["value"], report["agreement"]["metric"]))
    return "\n".join(lines) + "\n"


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main(argv=None):
    """Entry point (from ``python -m elasticep.bench --moe-layer``); returns the exit code."""
    try:
        args = _parse(sys.argv[1:] if argv is None else argv)
        import elasticep as ep

        backend = ep._C.resolve_backend(args.backend)
        if not ep.backend_available(backend):
            raise _UsageError("backend %s is not available here (%s compiled); use --backend cpu"
                              % (backend, ep._C.build_backends()))
        shared = {}
        if backend == "cuda":
            try:
                import torch
            except ImportError:
                raise _UsageError("--backend cuda runs on torch CUDA tensors: torch is not installed") from None
            shared["torch"] = torch
        if args.deepgemm:
            if backend != "cuda":
                raise _UsageError("--deepgemm needs the CUDA backend and a Hopper GPU")
            if args.quant_config != "fp8":
                raise _UsageError("--deepgemm runs DeepGEMM's FP8 grouped GEMMs: use --quant-config fp8")
            from .integrations.deepgemm import load_deep_gemm

            try:
                load_deep_gemm()
            except ImportError as e:
                raise _UsageError("--deepgemm: %s" % e) from None
        _defaults(args, backend == "cuda")
        json_file = None
        if args.json not in (None, "-"):
            try:
                json_file = open(args.json, "w")
            except OSError as e:
                raise _UsageError("--json %s: cannot open it for writing (%s)" % (args.json, e.strerror)) from None
        shared["weights"] = [None] * args.ranks
        paths, recs = [], {}
        todo = (["reference"] if args.reference or not args.deepgemm else []) + (["deepgemm"] if args.deepgemm else [])
        for path in todo:
            recs[path] = _run_path(args, backend, path, shared)
            paths.append(_summarise(path, recs[path]))
        agreement = _agreement(recs["reference"], recs["deepgemm"]) if len(recs) == 2 else None
        gpu = None
        if backend == "cuda":
            torch = shared["torch"]
            gpu = dict(name=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()))
        report = dict(tool=_TOOL, version=ep.__version__, backend=backend, gpu=gpu,
                      scenario=dict(phase=args.phase, ranks=args.ranks, tokens=args.tokens, capacity=args.capacity,
                                    hidden=args.hidden, intermediate=args.intermediate, experts=args.experts,
                                    topk=args.topk, quant=args.quant_config, routed_scaling=args.routed_scaling,
                                    skew=args.skew, rounds=args.rounds, warmup=args.warmup, seed=args.seed,
                                    timing="per round the slowest rank; %s" % ("CUDA events" if backend == "cuda"
                                                                               else "host clock")),
                      paths=paths, agreement=agreement)
    except _UsageError as e:
        sys.stderr.write("error: %s\n" % e)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001
        if os.environ.get("ELASTICEP_TRACEBACK"):
            raise
        sys.stderr.write("error: %s\n" % (getattr(e, "message", None) or str(e) or type(e).__name__))
        return 2
    text = json.dumps(report, indent=2) + "\n"
    if json_file is not None:
        json_file.write(text)
        json_file.close()
    sys.stdout.write(text if args.json == "-" else _table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
