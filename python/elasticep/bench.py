"""``python -m elasticep.bench``: rounds of dispatch + combine for torch (or numpy) users.

Mirrors ``elasticep bench`` with a smaller option set: the ranks are Python threads of this process
(one ThreadGroup), each with its own CUDA stream on the GPU backend. Every rank's latency per phase
is measured after a barrier; the report gives the slowest rank's median per phase and the bytes
moved. ``--verify`` reruns the same inputs on the CPU backend (the reference) and compares every
output exactly.

Example::

    python -m elasticep.bench --ranks 4 --experts 32 --topk 8 --hidden 7168 --tokens 64 --payload fp8
"""

import argparse
import statistics
import sys
import threading
import time

from . import Buffer, ThreadGroup, scale_columns


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m elasticep.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    p.add_argument("--max-tokens-per-rank", type=int, default=0, help="capacity C (0 = --tokens)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--payload", choices=["bf16", "fp8"], default="bf16")
    p.add_argument("--scale-format", choices=["f32_g128", "ue8m0_g128", "ue8m0_g32"], default="f32_g128")
    p.add_argument("--layout", choices=["contiguous", "masked"], default="contiguous")
    p.add_argument("--alignment", type=int, default=1)
    p.add_argument("--drop", type=float, default=0.0, help="probability that a route is -1")
    p.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--framework", choices=["auto", "torch", "numpy"], default="auto",
                   help="tensor type (auto: torch when importable)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout-ms", type=int, default=30000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--verify", action="store_true", help="compare every output with the CPU backend")
    return p.parse_args(argv)


def _inputs(args, rank):
    """(x bf16 bits [T,H] uint16, idx int64 [T,K], w fp32 [T,K]) as numpy, deterministic per rank."""
    import numpy as np

    rng = np.random.default_rng(args.seed * 1000 + rank)
    t, h, e, k = args.tokens, args.hidden, args.experts, args.topk
    xf = rng.standard_normal((t, h)).astype(np.float32)
    bits = xf.view(np.uint32).astype(np.uint64)
    x = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    idx = np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int64)
    idx[rng.random((t, k)) < args.drop] = -1
    w = rng.random((t, k)).astype(np.float32)
    return x, idx, w


def _to_framework(fw, device, arrays):
    if fw == "numpy":
        return arrays
    import torch

    x, idx, w = (torch.from_numpy(a.copy()) for a in arrays)
    return x.view(torch.bfloat16).to(device), idx.to(device), w.to(device)


def _run(args, backend, fw, collect):
    """Runs the rounds on `backend`; returns (per-round dispatch latencies, combine latencies, outputs)."""
    torch = None
    device = "cpu"
    if fw == "torch":
        import torch

        if backend != "cpu" and torch.cuda.is_available():
            device = "cuda"
    groups = ThreadGroup(args.ranks, timeout=args.timeout_ms / 1000.0)
    cap = args.max_tokens_per_rank or args.tokens
    lat = {"dispatch": [[0.0] * args.ranks for _ in range(args.rounds)],
           "combine": [[0.0] * args.ranks for _ in range(args.rounds)]}
    outputs = [None] * args.ranks
    errors = [None] * args.ranks
    barrier = threading.Barrier(args.ranks)

    def sync():
        if torch is not None and device == "cuda":
            torch.cuda.current_stream().synchronize()

    def rank_main(r):
        try:
            stream_ctx = torch.cuda.stream(torch.cuda.Stream()) if device == "cuda" else _Null()
            with stream_ctx:
                buf = Buffer(groups[r], num_experts=args.experts, num_topk=args.topk, hidden=args.hidden,
                             max_tokens_per_rank=cap, payload=args.payload, scale_format=args.scale_format,
                             timeout=args.timeout_ms / 1000.0, backend=backend)
                x, idx, w = _to_framework(fw, device, _inputs(args, r))
                for i in range(args.warmup + args.rounds):
                    barrier.wait()
                    t0 = time.perf_counter()
                    res = buf.dispatch(x, idx, w, layout=args.layout, expert_alignment=args.alignment)
                    sync()
                    t1 = time.perf_counter()
                    y = res.recv_x if args.payload == "bf16" else _fp8_identity_y(res, fw)
                    barrier.wait()
                    t2 = time.perf_counter()
                    out = buf.combine(y, res.handle)
                    sync()
                    t3 = time.perf_counter()
                    if i >= args.warmup:
                        lat["dispatch"][i - args.warmup][r] = (t1 - t0) * 1e6
                        lat["combine"][i - args.warmup][r] = (t3 - t2) * 1e6
                if collect:
                    outputs[r] = _snapshot(res, out)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors[r] = e
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(args.ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r, e in enumerate(errors):
        if e is not None and not isinstance(e, threading.BrokenBarrierError):
            raise RuntimeError("rank %d failed: %s: %s" % (r, type(e).__name__, e)) from e
    return lat["dispatch"], lat["combine"], outputs


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _fp8_identity_y(res, fw):
    """bf16 y of recv_x's shape for fp8 payloads: zeros (the bench times movement, not experts)."""
    if fw == "torch":
        import torch

        return torch.zeros(res.recv_x.shape, dtype=torch.bfloat16, device=res.recv_x.device)
    import numpy as np

    return np.zeros(res.recv_x.shape, np.uint16)


def _snapshot(res, out):
    """Copies of every output as numpy raw bits (for --verify)."""
    import numpy as np

    def raw(t):
        if t is None:
            return None
        if hasattr(t, "cpu"):  # torch
            import torch

            t = t.detach().cpu()
            if t.dtype in (torch.bfloat16,):
                t = t.view(torch.int16)
            elif t.dtype == getattr(torch, "float8_e4m3fn", None):
                t = t.view(torch.uint8)
            return t.numpy().copy()
        return np.array(t)

    snap = {k: raw(getattr(res, k)) for k in ("recv_x", "recv_scales", "recv_weights", "recv_src", "m_indices",
                                               "counts", "offsets", "masked_m")}
    snap["out"] = raw(out)
    return snap


def _summary(name, rounds, nbytes):
    worst = [max(r) for r in rounds]
    med = statistics.median(worst)
    gbps = nbytes / (med * 1e-6) / 1e9 if med > 0 else 0.0
    return "%-9s median %10.1f us  min %10.1f us  max %10.1f us  %8.2f GB/s" % (name, med, min(worst), max(worst),
                                                                                 gbps)


def main(argv=None):
    """Entry point of ``python -m elasticep.bench``; returns the process exit code."""
    args = _parse(argv)
    fw = args.framework
    if fw == "auto":
        try:
            import torch  # noqa: F401

            fw = "torch"
        except ImportError:
            fw = "numpy"
    from . import _C

    backend = _C.resolve_backend(args.backend)
    disp, comb, outs = _run(args, backend, fw, collect=args.verify)
    el = args.experts // args.ranks
    k_eff = args.topk * (1 - args.drop)
    row_bytes = args.hidden * (1 if args.payload == "fp8" else 2)
    if args.payload == "fp8":
        row_bytes += 4 * scale_columns(args.scale_format, args.hidden)
    # tokens on the wire: each token goes at most once to each destination rank
    dests = min(args.ranks, k_eff) if el > 0 else 0
    disp_bytes = args.ranks * args.tokens * dests * row_bytes
    comb_bytes = args.ranks * args.tokens * dests * args.hidden * 2
    print("elasticep.bench: ranks=%d tokens=%d hidden=%d experts=%d topk=%d payload=%s layout=%s backend=%s "
          "framework=%s rounds=%d" % (args.ranks, args.tokens, args.hidden, args.experts, args.topk, args.payload,
                                      args.layout, backend, fw, args.rounds))
    print(_summary("dispatch", disp, disp_bytes))
    print(_summary("combine", comb, comb_bytes))
    if args.verify:
        if backend == "cpu":
            print("verify: n/a (the CPU backend is the reference)")
            return 0
        _, _, ref = _run(args, "cpu", "numpy", collect=True)
        bad = []
        for r in range(args.ranks):
            for k, v in ref[r].items():
                got = outs[r][k]
                if (v is None) != (got is None) or (v is not None and (v.shape != got.shape or
                                                                       v.tobytes() != got.tobytes())):
                    bad.append("rank %d %s" % (r, k))
        print("verify against the CPU backend: %s" % ("OK (bit-exact)" if not bad else "MISMATCH " + ", ".join(bad)))
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
