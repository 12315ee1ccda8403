"""``python -m elasticep.bench``: the scenarios of ``elasticep bench`` through the Python API.

The same option names, defaults, routing (the C++ bench's generator, elasticep/_routing.py) and byte
accounting (the library's count, include/elasticep/traffic.hpp) as ``elasticep bench``; the ranks are
Python threads of this process (one ThreadGroup), each with its own CUDA stream on the GPU backend
(torch tensors) or on the CPU backend (torch CPU tensors or numpy arrays).

Per scenario (one table row per ``--tokens`` x ``--sms`` value):
  isolated      every round: barrier, timed dispatch, barrier, timed combine (warm-up rounds first);
  back-to-back  ``--rounds`` dispatch + combine pairs without host synchronisation (``--no-b2b`` skips);
  graph         ``--graph`` (torch on CUDA): one dispatch + combine captured into a CUDA graph, replayed.
Latency of a round = its slowest rank; the table shows medians. The stand-in expert is the identity in
bf16 (y = recv_x as bf16). With ``--backend cuda`` every output of every round is compared bit for bit
with the CPU backend run on the same inputs (``--no-verify`` skips); the CPU backend itself is checked
against the oracle by ``elasticep bench``.

Errors are one line on stderr (exit code 2); a failed comparison exits 1.

Example::

    python -m elasticep.bench --ranks 4 --experts 32 --topk 8 --hidden 7168 --tokens 16,64 --payload fp8
"""

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time

_TOOL = "python -m elasticep.bench"


class _UsageError(Exception):
    """A bad option: printed as one line, exit code 2."""


# ---- options ------------------------------------------------------------------------------------


def _int_range(name, lo, hi=None):
    def parse(text):
        want = ">= %d" % lo if hi is None else "in [%d, %d]" % (lo, hi)
        try:
            v = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError("%s must be an integer %s, got '%s'" % (name, want, text)) from None
        if v < lo or (hi is not None and v > hi) or v > 2**31 - 1:
            raise argparse.ArgumentTypeError("%s must be %s, got %s" % (name, want if v < 2**31 else "<= 2147483647",
                                                                        text))
        return v

    return parse


def _int_list(name, lo):
    one = _int_range(name, lo)
    return lambda text: [one(t) for t in text.split(",")]


def _real_range(name, lo, hi=None):
    def parse(text):
        want = ">= %g" % lo if hi is None else "in [%g, %g]" % (lo, hi)
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError("%s must be a number %s, got '%s'" % (name, want, text)) from None
        if math.isnan(v) or v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError("%s must be %s, got %s" % (name, want, text))
        return v

    return parse


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as the C++ CLI: "error: --ranks must be >= 1, got 0"
        if message.startswith("argument "):
            head, _, rest = message[len("argument "):].partition(": ")
            message = rest if rest.startswith("-") else head.split("/")[0] + ": " + rest
        raise _UsageError(message)


def _parse(argv):
    p = _Parser(prog=_TOOL, description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="Options as `elasticep bench` (its --help says more); --framework is this tool's own.")
    a = p.add_argument
    a("--ranks", "-r", type=_int_range("--ranks", 1), default=None, help="ranks (threads of this process) [8]")
    a("--tokens", "-t", type=_int_list("--tokens", 0), default=[128],
      help="tokens per rank; a comma list runs one row per value [128]")
    a("--max-tokens-per-rank", "--capacity", dest="capacity", type=_int_range("--max-tokens-per-rank", 0), default=0,
      help="buffer capacity C per rank (0 = --tokens)")
    a("--hidden", type=_int_range("--hidden", 1), default=7168)
    a("--experts", "-e", type=_int_range("--experts", 1), default=256)
    a("--topk", "-k", type=_int_range("--topk", 1, 32), default=8)
    a("--payload", choices=["bf16", "fp8"], default="fp8")
    a("--scale-format", choices=["f32_g128", "ue8m0_g128", "ue8m0_g32"], default="f32_g128")
    a("--alignment", "-a", type=_int_range("--alignment", 1, 65536), default=1)
    a("--layout", choices=["contiguous", "masked"], default="contiguous")
    a("--graph-mode", action="store_true", help="contiguous: fixed M_cap rows, no host sync")
    a("--graph", action="store_true", help="torch on CUDA: also time a captured dispatch + combine, replayed "
      "(implies --graph-mode)")
    a("--no-b2b", dest="b2b", action="store_false", help="skip the back-to-back timing")
    a("--gpus", type=_int_range("--gpus", 1), default=1, help="cuda: GPUs the ranks spread over (rank r on r %% N)")
    a("--no-weights", dest="weighted", action="store_false", help="no route weights (combine sums)")
    a("--skew", type=_real_range("--skew", 0), default=0.8)
    a("--drop", type=_real_range("--drop", 0, 1), default=0.0, help="probability that a route is -1")
    a("--sms", "--num-sms", type=_int_list("--sms", 0), default=[0], help="SMs (0 = the library's choice); a list")
    a("--rounds", "-n", type=_int_range("--rounds", 1), default=5)
    a("--warmup", "-w", type=_int_range("--warmup", 0), default=1)
    a("--seed", type=_int_range("--seed", 0), default=1)
    a("--timeout-ms", type=_int_range("--timeout-ms", 1), default=30000)
    a("--backend", choices=["auto", "cpu", "cuda"], default="auto")
    a("--no-verify", dest="verify", action="store_false", help="skip the comparison with the CPU backend")
    a("--json", nargs="?", const="-", default=None, metavar="FILE",
      help="the report as JSON on stdout instead of the table; with FILE, into FILE (the table on stdout)")
    a("--no-progress", dest="progress", action="store_false")
    a("--framework", choices=["auto", "torch", "numpy"], default="auto", help="tensor type (auto: torch if importable)")
    # self-tests of the comparison (as `elasticep bench --inject-mismatch`): compare a CPU-backend run
    # with a second one, and alter one byte of what the first round returned; the run must then fail
    a("--verify-cpu", action="store_true", help=argparse.SUPPRESS)
    a("--inject-mismatch", choices=["none", "dispatch", "combine"], default="none", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ranks is None:
        args.ranks = args.gpus if args.gpus > 1 else 8
    return args


def _check_scenario(args, tokens):
    """The checks `elasticep bench` makes before it runs anything (the library checks the rest)."""
    if args.capacity and args.capacity < tokens:
        raise _UsageError("--max-tokens-per-rank %d is below --tokens %d; raise it or lower --tokens"
                          % (args.capacity, tokens))
    if args.experts % args.ranks:
        raise _UsageError("--experts %d is not a multiple of --ranks %d" % (args.experts, args.ranks))
    if args.topk > args.experts:
        raise _UsageError("--topk %d exceeds --experts %d (a token's experts are distinct)" % (args.topk, args.experts))
    if args.gpus > args.ranks:
        raise _UsageError("--gpus %d exceeds --ranks %d (a GPU without a rank)" % (args.gpus, args.ranks))


# ---- inputs -------------------------------------------------------------------------------------


def _bf16_bits(f32):
    """float32 -> bf16 bits (round to nearest even), numpy."""
    import numpy as np

    bits = np.ascontiguousarray(f32, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _e4m3_to_bf16_table():
    """bf16 bits of every E4M3 code (exact: E4M3 values are bf16 values); NaN codes -> bf16 NaN."""
    import numpy as np

    vals = np.zeros(256, np.float32)
    for c in range(256):
        s, e, m = c >> 7, (c >> 3) & 0xF, c & 7
        if e == 0xF and m == 7:
            vals[c] = np.nan
        elif e == 0:
            vals[c] = m / 8.0 * 2.0**-6
        else:
            vals[c] = (1 + m / 8.0) * 2.0 ** (e - 7)
        vals[c] = -vals[c] if s else vals[c]
    return _bf16_bits(vals)


def _rank_inputs(args, tokens, rank):
    """(x bf16 bits [T,H], topk_idx int64 [T,K], weights fp32 [T,K] or None), numpy, deterministic."""
    import numpy as np

    from . import _routing

    idx, w = _routing.make_routing(rank, tokens, args.experts, args.topk, skew=args.skew, drop=args.drop,
                                   seed=args.seed, weighted=args.weighted)
    rng = np.random.default_rng(args.seed * 1000 + rank)
    x = _bf16_bits(rng.standard_normal((tokens, args.hidden), dtype=np.float32))
    return x, idx, w


# ---- frameworks ---------------------------------------------------------------------------------


class _Numpy:
    name = "numpy"

    def __init__(self):
        import numpy as np

        self.np = np
        self.table = None

    def device(self, backend, rank, gpus):
        if backend == "cuda":
            raise _UsageError("numpy arrays live on the host: --backend cuda needs torch CUDA tensors "
                              "(pip install torch) or use --backend cpu")
        return None

    def stream(self, device):
        return None

    def tensors(self, device, x, idx, w):
        return x, idx, w

    def y_of(self, recv_x, payload):
        np = self.np
        if payload == "bf16":
            return np.array(recv_x, dtype=np.uint16)
        if self.table is None:
            self.table = _e4m3_to_bf16_table()
        return self.table[np.asarray(recv_x).view(np.uint8)]

    def zeros_like_out(self, device, shape):
        return self.np.zeros(shape, self.np.uint16)

    def host_bits(self, t):
        return None if t is None else self.np.array(t)

    def clock(self, stream):
        return _HostClock()

    def sync(self, stream):
        pass


class _HostClock:
    def __init__(self):
        self.t = {}

    def mark(self, i):
        self.t[i] = time.perf_counter()

    def elapsed_us(self, a, b):
        return (self.t[b] - self.t[a]) * 1e6


class _Torch:
    name = "torch"

    def __init__(self):
        import torch

        self.torch = torch

    def device(self, backend, rank, gpus):
        if backend == "cuda":
            if not self.torch.cuda.is_available():
                raise _UsageError("--backend cuda: torch sees no CUDA device")
            if gpus > self.torch.cuda.device_count():
                raise _UsageError("--gpus %d but torch sees %d GPU(s); lower --gpus"
                                  % (gpus, self.torch.cuda.device_count()))
            return self.torch.device("cuda", rank % gpus)
        return self.torch.device("cpu")

    def stream(self, device):
        return self.torch.cuda.Stream(device) if device.type == "cuda" else None

    def tensors(self, device, x, idx, w):
        t = self.torch
        return (t.from_numpy(x.copy()).view(t.bfloat16).to(device), t.from_numpy(idx.copy()).to(device),
                None if w is None else t.from_numpy(w.copy()).to(device))

    def y_of(self, recv_x, payload):
        return recv_x.to(self.torch.bfloat16).clone()

    def zeros_like_out(self, device, shape):
        return self.torch.zeros(shape, dtype=self.torch.bfloat16, device=device)

    def host_bits(self, t):
        if t is None:
            return None
        t = t.detach().cpu()
        if t.dtype == self.torch.bfloat16:
            t = t.view(self.torch.int16)
        elif t.dtype == getattr(self.torch, "float8_e4m3fn", None):
            t = t.view(self.torch.uint8)
        return t.numpy().copy()

    def clock(self, stream):
        return _CudaClock(self.torch, stream) if stream is not None else _HostClock()

    def sync(self, stream):
        if stream is not None:
            stream.synchronize()


class _CudaClock:
    def __init__(self, torch, stream):
        self.torch, self.stream, self.ev = torch, stream, {}

    def mark(self, i):
        if i not in self.ev:
            self.ev[i] = self.torch.cuda.Event(enable_timing=True)
        self.ev[i].record(self.stream)

    def elapsed_us(self, a, b):
        return self.ev[a].elapsed_time(self.ev[b]) * 1e3


def _framework(name):
    if name in ("auto", "torch"):
        try:
            return _Torch()
        except ImportError:
            if name == "torch":
                raise _UsageError("--framework torch: torch is not installed") from None
    return _Numpy()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# ---- one scenario -------------------------------------------------------------------------------

_OUTS = ("recv_x", "recv_scales", "recv_weights", "recv_src", "m_indices", "counts", "offsets", "masked_m")


def _snapshot(fw, res):
    """Host copies of a dispatch's outputs with the parts SEMANTICS.md leaves unspecified zeroed: the
    data and scales of padding rows (contiguous: m_indices == -1), and every slab row at or past
    masked_m of its expert (masked). What remains must be equal on every backend."""
    import numpy as np

    snap = {k: fw.host_bits(getattr(res, k)) for k in _OUTS}
    if snap["m_indices"] is not None:  # contiguous
        pad = snap["m_indices"] < 0
        for k in ("recv_x", "recv_scales"):
            if snap[k] is not None:
                snap[k][pad] = 0
    else:  # masked [E_local, R*C, ...]
        rows = snap["recv_x"].shape[1]
        pad = np.arange(rows)[None, :] >= snap["masked_m"].astype(np.int64)[:, None]
        for k in ("recv_x", "recv_scales", "recv_weights", "recv_src"):
            if snap[k] is not None:
                snap[k][pad] = 0
    return snap


def _diff(got, want, what):
    """First difference between two snapshots (dicts of numpy arrays), or None."""
    import numpy as np

    for k in want:
        a, b = got.get(k), want[k]
        if (a is None) != (b is None):
            return "%s: %s is %s, want %s" % (what, k, "absent" if a is None else "present",
                                               "absent" if b is None else "present")
        if a is not None and (a.shape != b.shape or a.tobytes() != b.tobytes()):
            if a.shape != b.shape:
                return "%s: %s has shape %s, want %s" % (what, k, list(a.shape), list(b.shape))
            at = np.argwhere(a.reshape(-1).view(np.uint8) != b.reshape(-1).view(np.uint8))[0][0]
            return "%s: %s differs at byte %d (%d mismatching bytes)" % (
                what, k, at, int((a.reshape(-1).view(np.uint8) != b.reshape(-1).view(np.uint8)).sum()))
    return None


def _run_ranks(args, backend, fw, tokens, sms, reference=None, collect=False):
    """Runs one scenario; returns per-rank records."""
    import elasticep as ep

    nr = args.ranks
    groups = ep.ThreadGroup(nr, timeout=args.timeout_ms / 1000.0)
    recs = [dict(d=[], c=[], bd=[], bc=[], g=[], bg=[], checks_d=[], checks_c=[], checks_g=[], failures=[],
                 num_sms=0, snapshot=None) for _ in range(nr)]
    errors = [None] * nr
    barrier = threading.Barrier(nr)
    host_sync = args.layout == "contiguous" and not args.graph_mode and not args.graph  # captured: no host sync

    def rank_main(r):
        rec = recs[r]
        try:
            device = fw.device(backend, r, args.gpus)
            stream = fw.stream(device)
            ctx = fw.torch.cuda.stream(stream) if stream is not None else _Null()
            with ctx:
                buf = ep.Buffer(groups[r], num_experts=args.experts, num_topk=args.topk, hidden=args.hidden,
                                max_tokens_per_rank=args.capacity or max(tokens, 1), payload=args.payload,
                                scale_format=args.scale_format, num_sms=sms, timeout=args.timeout_ms / 1000.0,
                                backend=backend, device=None if device is None or device.type != "cuda" else device.index)
                x, idx, w = fw.tensors(device, *_rank_inputs(args, tokens, r))
                clock = fw.clock(stream)
                kw = dict(layout=args.layout, expert_alignment=args.alignment, host_sync=host_sync)
                out_iso = fw.zeros_like_out(device, (tokens, args.hidden))
                out_b2b = [fw.zeros_like_out(device, (tokens, args.hidden)) for _ in range(args.rounds if args.b2b else 0)]
                out_graph = fw.zeros_like_out(device, (tokens, args.hidden)) if args.graph else None
                y = None
                want = reference[r] if reference is not None else None

                def check(res, out, what, checks_d, checks_c):
                    if want is None:
                        return
                    inject = r == 0 and what == "round %d" % args.warmup
                    if res is not None:
                        got = _snapshot(fw, res)
                        if inject and args.inject_mismatch == "dispatch" and got["recv_src"].size:
                            got["recv_src"].reshape(-1)[0] ^= 1
                        bad = _diff(got, want["dispatch"], what + " dispatch")
                        checks_d.append(bad is None)
                        if bad and len(rec["failures"]) < 8:
                            rec["failures"].append("rank %d %s" % (r, bad))
                    if out is not None:
                        got = fw.host_bits(out)
                        if inject and args.inject_mismatch == "combine" and got.size:
                            got.reshape(-1)[0] ^= 1
                        bad = _diff({"out": got}, {"out": want["out"]}, what + " combine")
                        checks_c.append(bad is None)
                        if bad and len(rec["failures"]) < 8:
                            rec["failures"].append("rank %d %s" % (r, bad))

                for i in range(args.warmup + args.rounds):
                    fw.sync(stream)
                    barrier.wait()
                    clock.mark(0)
                    res = buf.dispatch(x, idx, w, **kw)
                    clock.mark(1)
                    fw.sync(stream)
                    rec["d"].append(clock.elapsed_us(0, 1))
                    if y is None:
                        rec["num_sms"] = res.handle.num_sms
                        y = fw.y_of(res.recv_x, args.payload)
                    check(res, None, "round %d" % i, rec["checks_d"], rec["checks_c"])
                    dispatch_snap = _snapshot(fw, res) if collect and i == 0 else None
                    fw.sync(stream)
                    barrier.wait()
                    clock.mark(2)
                    buf.combine(y, res.handle, weighted=args.weighted, out=out_iso)
                    clock.mark(3)
                    fw.sync(stream)
                    rec["c"].append(clock.elapsed_us(2, 3))
                    check(None, out_iso, "round %d" % i, rec["checks_d"], rec["checks_c"])
                    if collect and i == 0:
                        rec["snapshot"] = {"dispatch": dispatch_snap, "out": fw.host_bits(out_iso)}
                buf.check()

                if args.b2b:
                    fw.sync(stream)
                    barrier.wait()
                    last = None
                    for i in range(args.rounds):
                        clock.mark(3 * i)
                        res = buf.dispatch(x, idx, w, **kw)
                        clock.mark(3 * i + 1)
                        buf.combine(y, res.handle, weighted=args.weighted, out=out_b2b[i])
                        clock.mark(3 * i + 2)
                        last = res
                    fw.sync(stream)
                    for i in range(args.rounds):
                        rec["bd"].append(clock.elapsed_us(3 * i, 3 * i + 1))
                        rec["bc"].append(clock.elapsed_us(3 * i + 1, 3 * i + 2))
                    check(last, None, "back-to-back round %d" % (args.rounds - 1), rec["checks_d"], rec["checks_c"])
                    for i in range(args.rounds):
                        check(None, out_b2b[i], "back-to-back round %d" % i, rec["checks_d"], rec["checks_c"])
                    buf.check()

                if args.graph:
                    torch = fw.torch
                    fw.sync(stream)
                    barrier.wait()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, stream=stream, capture_error_mode="thread_local"):
                        gres = buf.dispatch(x, idx, w, **kw)
                        buf.combine(y, gres.handle, weighted=args.weighted, out=out_graph)
                    for i in range(args.warmup + args.rounds):
                        fw.sync(stream)
                        barrier.wait()
                        clock.mark(0)
                        g.replay()
                        clock.mark(1)
                        fw.sync(stream)
                        rec["g"].append(clock.elapsed_us(0, 1))
                    fw.sync(stream)
                    barrier.wait()
                    for i in range(args.rounds):
                        clock.mark(i)
                        g.replay()
                    clock.mark(args.rounds)
                    fw.sync(stream)
                    rec["bg"] = [clock.elapsed_us(i, i + 1) for i in range(args.rounds)]
                    ok_before = len(rec["failures"])
                    check(gres, out_graph, "graph replay", [], [])
                    rec["checks_g"].append(len(rec["failures"]) == ok_before)
                    buf.check()
                barrier.wait()
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors[r] = e
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(nr)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # a failing rank makes its peers time out or break the barrier: report the cause
    real = [e for e in errors if e is not None and not isinstance(e, (threading.BrokenBarrierError, ep.TimeoutError))]
    for e in real + [e for e in errors if e is not None]:
        raise e
    return recs


def _timing(recs, key, skip=0):
    n = len(recs[0][key])
    rounds = [max(rec[key][i] for rec in recs) for i in range(skip, n)]
    if not rounds:
        return None
    return {"median": statistics.median(rounds), "mean": statistics.fmean(rounds), "min": min(rounds),
            "max": max(rounds), "rounds": rounds, "per_rank": [[rec[key][i] for rec in recs] for i in range(skip, n)]}


def _tally(recs, key):
    n = len(recs[0][key])
    ok = sum(1 for i in range(n) if all(rec[key][i] for rec in recs))
    return ok, n - ok


def _traffic(args, tokens):
    """The library's count (include/elasticep/traffic.hpp) over every rank's routing."""
    import numpy as np

    from . import _C

    total = None
    for r in range(args.ranks):
        idx = _routing_idx(args, tokens, r)
        params = {"num_experts": args.experts, "num_topk": args.topk, "hidden": args.hidden,
                  "payload": args.payload, "scale_format": args.scale_format}
        t = _C.count_traffic(params, args.ranks, r, np.ascontiguousarray(idx, dtype=np.int64), False)
        total = t if total is None else {k: (total[k] + v if k not in ("message_bytes", "partial_bytes") else v)
                                         for k, v in t.items()}
    return total


def _routing_idx(args, tokens, rank):
    from . import _routing

    return _routing.make_routing(rank, tokens, args.experts, args.topk, skew=args.skew, drop=args.drop,
                                 seed=args.seed, weighted=False)[0]


def _hbm_gbps(fw):
    """Device copy bandwidth (read + write) of GPU 0, as `elasticep bench` measures it."""
    torch = fw.torch
    n = 512 << 20
    src = torch.ones(n // 4, dtype=torch.float32, device="cuda:0")
    dst = torch.empty_like(src)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = []
    for i in range(13):
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 3:
            ms.append(a.elapsed_time(b))
    del src, dst
    return 2.0 * n / (statistics.median(ms) * 1e-3) / 1e9


def _phase(t, timing, b2b, peer_bytes, local_bytes, hbm_bytes, hbm_min_bytes, hbm, verify, checks):
    med = timing["median"] if timing else 0.0
    ok, bad = checks
    return {"latency_us": timing, "back_to_back_us": b2b, "peer_messages": t["peer_messages"],
            "local_messages": t["local_messages"], "peer_bytes": peer_bytes, "local_bytes": local_bytes,
            "peer_gbps": peer_bytes / (med * 1e3) if med > 0 else 0.0,
            "total_gbps": (peer_bytes + local_bytes) / (med * 1e3) if med > 0 else 0.0, "hbm_bytes": hbm_bytes,
            "hbm_floor_us": hbm_bytes / (hbm * 1e3) if hbm else None, "hbm_min_bytes": hbm_min_bytes,
            "hbm_min_floor_us": hbm_min_bytes / (hbm * 1e3) if hbm else None, "verified": (bad == 0) if verify else None,
            "rounds_verified": ok if verify else 0, "rounds_failed": bad if verify else 0}


def _verifies(args, backend):
    return args.verify and (backend != "cpu" or args.verify_cpu)


def _run_row(args, backend, fw, tokens, sms, hbm):
    verify = _verifies(args, backend)
    t0 = time.perf_counter()
    reference = None
    if verify:  # the CPU backend on the same inputs, numpy, one isolated round
        import copy

        ref_args = copy.copy(args)
        ref_args.warmup, ref_args.rounds, ref_args.b2b, ref_args.graph = 0, 1, False, False
        ref_args.inject_mismatch = "none"
        # (snapshots compare bytes and shapes: numpy's uint16 bf16 bits equal torch's int16 view)
        reference = [rec["snapshot"] for rec in _run_ranks(ref_args, "cpu", _Numpy(), tokens, sms, collect=True)]
    recs = _run_ranks(args, backend, fw, tokens, sms, reference=reference)
    t = _traffic(args, tokens)
    msg, part = t["message_bytes"], t["partial_bytes"]
    d = _phase(t, _timing(recs, "d", args.warmup), _timing(recs, "bd"), t["peer_messages"] * msg,
               t["local_messages"] * msg, t["dispatch_hbm_bytes"], t["dispatch_min_hbm_bytes"], hbm, verify,
               _tally(recs, "checks_d"))
    c = _phase(t, _timing(recs, "c", args.warmup), _timing(recs, "bc"), t["peer_messages"] * part,
               t["local_messages"] * part, t["combine_hbm_bytes"], t["combine_min_hbm_bytes"], hbm, verify,
               _tally(recs, "checks_c"))
    g = None
    if args.graph:
        g = _phase(t, _timing(recs, "g", args.warmup), _timing(recs, "bg"), t["peer_messages"] * (msg + part),
                   t["local_messages"] * (msg + part), t["dispatch_hbm_bytes"] + t["combine_hbm_bytes"],
                   t["dispatch_min_hbm_bytes"] + t["combine_min_hbm_bytes"], hbm, verify, _tally(recs, "checks_g"))
    failures = [f for rec in recs for f in rec["failures"]][:8]
    traffic = dict(t, dispatch_peer_bytes=t["peer_messages"] * msg, dispatch_local_bytes=t["local_messages"] * msg,
                   combine_peer_bytes=t["peer_messages"] * part, combine_local_bytes=t["local_messages"] * part)
    return {"tokens": tokens, "tokens_per_rank": [tokens] * args.ranks,
            "max_tokens_per_rank": args.capacity or max(tokens, 1), "num_sms": sms, "num_sms_used": recs[0]["num_sms"],
            "message_bytes": msg, "routes_per_round": t["routes"], "traffic": traffic,
            "phases": {"dispatch": d, "combine": c, "graph": g},
            "verified": (not failures and all(p["rounds_failed"] == 0 for p in (d, c, g) if p)) if verify else None,
            "failures": failures, "seconds": {"wall": time.perf_counter() - t0}}


# ---- report -------------------------------------------------------------------------------------


def _fmt_us(v):
    if v is None:
        return "-"
    return "%.0f" % v if v >= 10000 else "%.1f" % v


def _table(report):
    s = report["scenario"]
    rows = report["results"]
    floor = report["hbm"] is not None
    graph = s["graph"]
    cuda = report["backend"] == "cuda"
    out = ["%s: %s backend (%s), %d ranks%s, H=%d, E=%d (%d/rank), top-%d, %s dispatch, bf16 combine, %s, %s" % (
        _TOOL, report["backend"], report["framework"], s["ranks"], " on %d GPU(s)" % s["gpus"] if cuda else "",
        s["hidden"], s["experts"], s["experts"] // s["ranks"], s["topk"],
        s["payload"] + (" " + s["scale_format"] if s["payload"] == "fp8" else ""),
        s["layout"] + (" A=%d" % s["alignment"] if s["layout"] == "contiguous" else ""),
        "weighted" if s["weighted"] else "unweighted")]
    out.append("rounds: %d timed + %d warm-up per row, seed %d; latency = the slowest rank per round, median; "
               "isolated: a barrier before every call; b2b: back to back" % (s["rounds"], s["warmup"], s["seed"]))
    out.append("bytes: one %d B message per token and destination rank; combine returns one %d B row per message"
               % (rows[0]["traffic"]["message_bytes"], rows[0]["traffic"]["partial_bytes"]))
    if floor:
        out.append("HBM floor = device-memory bytes of every rank / %.0f GB/s (measured device copy)"
                   % report["hbm"]["gbps"])
    out.append("")
    h1 = "                         "
    h2 = " tokens  sms   peer msgs "
    for name in ("dispatch us", "combine us"):
        h1 += "| %-*s" % (40 if floor else 30, name)
        h2 += "| %10s %8s %9s%s " % ("isolated", "b2b", "GB/s", "  floor us" if floor else "")
    if graph:
        h1 += "| %-20s" % "graph D+C us"
        h2 += "| %10s %8s " % ("isolated", "b2b")
    out += [h1 + "|", h2 + "| verified"]
    for r in rows:
        sms = ("%d%s" % (r["num_sms_used"], "*" if r["num_sms"] == 0 else "")) if cuda else "-"
        line = " %6d %4s %11d " % (r["tokens"], sms, r["traffic"]["peer_messages"])
        for ph in ("dispatch", "combine"):
            p = r["phases"][ph]
            b2b = p["back_to_back_us"]["median"] if p["back_to_back_us"] else None
            line += "| %10s %8s %9.2f%s " % (_fmt_us(p["latency_us"]["median"]), _fmt_us(b2b), p["peer_gbps"],
                                              " %9s" % _fmt_us(p["hbm_floor_us"]) if floor else "")
        if graph:
            p = r["phases"]["graph"]
            line += "| %10s %8s " % (_fmt_us(p["latency_us"]["median"]), _fmt_us(p["back_to_back_us"]["median"]))
        if r["verified"] is None:
            cell = "n/a (cpu)" if report["backend"] == "cpu" and s["verify"] else "off"
        else:
            ok = sum(r["phases"][k]["rounds_verified"] for k in ("dispatch", "combine", "graph") if r["phases"][k])
            bad = sum(r["phases"][k]["rounds_failed"] for k in ("dispatch", "combine", "graph") if r["phases"][k])
            cell = "%s (%d/%d)" % ("yes" if bad == 0 else "NO", ok, ok + bad)
        out.append(line + "| " + cell)
    out.append("")
    for r in rows:
        for f in r["failures"]:
            out.append("mismatch (T=%d): %s" % (r["tokens"], f))
    v = report["verified"]
    verdict = "PASS" if v else "FAIL" if v is False else (
        "not compared (the CPU backend is the reference; `elasticep bench` checks it against the oracle)"
        if report["backend"] == "cpu" and s["verify"] else "UNVERIFIED (--no-verify)")
    out.append("summary: %s; %d row%s; peer bytes per round (first row): dispatch %d B, combine %d B" % (
        verdict, len(rows), "" if len(rows) == 1 else "s", rows[0]["phases"]["dispatch"]["peer_bytes"],
        rows[0]["phases"]["combine"]["peer_bytes"]))
    return "\n".join(out) + "\n"


def _report(args, backend, fw):
    hbm = None
    if backend == "cuda" and args.gpus == 1 and fw.name == "torch":
        hbm = _hbm_gbps(fw)
    from . import __version__

    results = []
    for tokens in args.tokens:
        for sms in args.sms:
            if args.progress and sys.stderr.isatty():
                sys.stderr.write("\rT=%d sms=%d ..." % (tokens, sms))
                sys.stderr.flush()
            results.append(_run_row(args, backend, fw, tokens, sms, hbm))
    if args.progress and sys.stderr.isatty():
        sys.stderr.write("\r%40s\r" % "")
    verified = None
    if _verifies(args, backend):
        verified = all(r["verified"] for r in results)
    return {"tool": _TOOL, "version": __version__, "backend": backend, "framework": fw.name,
            "scenario": {"ranks": args.ranks, "gpus": args.gpus if backend == "cuda" else None,
                         "max_tokens_per_rank": args.capacity, "hidden": args.hidden, "experts": args.experts,
                         "topk": args.topk, "payload": args.payload,
                         "scale_format": args.scale_format if args.payload == "fp8" else None,
                         "layout": args.layout, "alignment": args.alignment,
                         "host_sync": args.layout == "contiguous" and not args.graph_mode and not args.graph, "weighted": args.weighted,
                         "skew": args.skew, "drop": args.drop, "back_to_back": args.b2b, "graph": args.graph,
                         "rounds": args.rounds, "warmup": args.warmup, "seed": args.seed, "verify": args.verify},
            "hbm": {"gbps": hbm, "measured": True} if hbm else None, "results": results, "verified": verified}


def main(argv=None):
    """Entry point of ``python -m elasticep.bench``; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--moe-layer" in argv:  # the whole MoE layer, timed per stage (optionally on DeepGEMM): moe_bench.py
        from . import moe_bench

        return moe_bench.main(argv)
    try:
        args = _parse(argv)
        for tokens in args.tokens:
            _check_scenario(args, tokens)
        json_file = None
        if args.json not in (None, "-"):
            try:
                json_file = open(args.json, "w")
            except OSError as e:
                raise _UsageError("--json %s: cannot open it for writing (%s); create its folder first"
                                  % (args.json, e.strerror)) from None
        import elasticep as ep

        fw = _framework(args.framework)
        backend = ep._C.resolve_backend(args.backend)
        if not ep.backend_available(backend):
            raise _UsageError("backend %s is not available here (%s compiled; see `python -m elasticep`); use "
                              "--backend cpu" % (backend, ep._C.build_backends()))
        if backend == "cuda" and fw.name == "numpy":
            fw.device(backend, 0, 1)  # the one-line reason
        if backend != "cuda" and (args.graph or args.gpus > 1):
            raise _UsageError("--graph" if args.graph else "--gpus %d" % args.gpus + " needs --backend cuda")
        if args.graph and fw.name != "torch":
            raise _UsageError("--graph captures a torch CUDA graph: it needs torch")
        report = _report(args, backend, fw)
    except _UsageError as e:
        sys.stderr.write("error: %s\n" % e)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - a library error: one line, not a traceback
        if os.environ.get("ELASTICEP_TRACEBACK"):
            raise
        sys.stderr.write("error: %s\n" % (getattr(e, "message", None) or str(e) or type(e).__name__))
        return 2
    text = json.dumps(report, indent=2) + "\n"
    if json_file is not None:
        json_file.write(text)
        json_file.close()
    sys.stdout.write(text if args.json == "-" else _table(report))
    return 1 if report["verified"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
