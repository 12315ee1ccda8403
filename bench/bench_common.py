"""Shared pieces of the comparison baselines in bench/ (torch_emulation.py, nccl_alltoall.py).

- The routing generator of `elasticep bench` (tools/inputs.cpp): splitmix64 streams, expert popularity
  ~ 1/(rank+1)^skew over a seeded permutation, K distinct experts per token drawn by Efraimidis-Spirakis
  keys, weights 0.05 + U[0,1) normalised per token. The same seed gives the same topk_idx and
  topk_weights as the C++ bench, so the traffic (messages, bytes) of every baseline equals ElasticEP's.
- The wire message size of one token (src/core/layout.hpp, MessageLayout) that defines "bytes moved".
- The FP8 quantizer of SEMANTICS.md (f32_g128) written with torch ops.
- Timing helpers: CUDA events (or perf_counter on CPU), an L2 flush, and statistics.

Only numpy and torch are needed.
"""
from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass

import numpy as np

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
STREAM_MUL = 0xD1B54A32D192ED03
K_EXPERTS, K_X, K_ROUTES, K_WEIGHTS = 1, 2, 3, 4
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
SCALE_GROUP = 128


def round_up(v: int, a: int) -> int:
    return (v + a - 1) // a * a


def message_bytes(hidden: int, topk: int, payload_elem_bytes: int, scale_cols: int) -> int:
    """Bytes of one token on the wire, as MessageLayout::make in src/core/layout.hpp."""
    return (round_up(hidden * payload_elem_bytes, 16) + round_up(scale_cols * 4, 16) + 2 * round_up(topk * 4, 16)
            + 16)


class SplitMix64:
    """The Rng of tools/inputs.cpp, vectorised: draw i (1-based) mixes state0 + i * GOLDEN."""

    def __init__(self, seed: int, stream: int):
        self.state = ((seed * GOLDEN) ^ ((stream + 1) * STREAM_MUL)) & MASK64

    def next_u64(self, n: int) -> np.ndarray:
        with np.errstate(over="ignore"):
            z = np.uint64(self.state) + np.arange(1, n + 1, dtype=np.uint64) * np.uint64(GOLDEN)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = z ^ (z >> np.uint64(31))
        self.state = (self.state + n * GOLDEN) & MASK64
        return z

    def next_scalar(self) -> int:
        self.state = (self.state + GOLDEN) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return ((self.next_scalar() >> 32) * n) >> 32

    def uniform(self, n: int) -> np.ndarray:  # float32 in [0, 1)
        return (self.next_u64(n) >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / 16777216.0)

    def uniform_open(self, n: int) -> np.ndarray:  # float64 in (0, 1)
        return ((self.next_u64(n) >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / 9007199254740992.0)


def stream_of(rank: int, stream: int) -> int:
    return rank * 16 + stream


def expert_popularity(num_experts: int, skew: float, seed: int) -> np.ndarray:
    perm = list(range(num_experts))
    rng = SplitMix64(seed, stream_of(0, K_EXPERTS))
    for i in range(num_experts - 1, 0, -1):
        j = rng.below(i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    pop = np.empty(num_experts, dtype=np.float64)
    for i in range(num_experts):
        pop[perm[i]] = math.pow(i + 1.0, -skew)
    return pop


def make_routing(rank: int, tokens: int, num_experts: int, topk: int, *, skew: float = 0.8, drop: float = 0.0,
                 seed: int = 1, weighted: bool = True, popularity: np.ndarray | None = None):
    """topk_idx [T, K] int64 and topk_weights [T, K] float32 (or None) of one rank, as tools/inputs.cpp."""
    if popularity is None:
        popularity = expert_popularity(num_experts, skew, seed)
    rr = SplitMix64(seed, stream_of(rank, K_ROUTES))
    per_token = num_experts + (topk if drop > 0.0 else 0)
    draws = rr.uniform_open(tokens * per_token).reshape(tokens, per_token)
    keys = -np.log(draws[:, :num_experts]) / popularity[None, :]
    order = np.argsort(keys, axis=1, kind="stable")[:, :topk]  # ties broken by expert id, as partial_sort of pairs
    idx = order.astype(np.int64)
    dropped = np.zeros((tokens, topk), dtype=bool)
    if drop > 0.0:
        dropped = draws[:, num_experts:] < drop
        idx[dropped] = -1
    weights = None
    if weighted:
        wr = SplitMix64(seed, stream_of(rank, K_WEIGHTS))
        weights = np.zeros((tokens, topk), dtype=np.float32)
        live = ~dropped
        weights[live] = np.float32(0.05) + wr.uniform(int(live.sum()))  # row-major = the C++ draw order
        total = np.zeros(tokens, dtype=np.float32)
        for j in range(topk):  # float32 sum in k order
            total = total + weights[:, j]
        nz = total > 0
        weights[nz] = weights[nz] / total[nz, None]
    return idx, weights


def traffic(idx_per_rank, num_ranks: int, num_experts: int):
    """Messages (one per token and destination rank) to peers and to self, and routes, all ranks together."""
    e_local = num_experts // num_ranks
    peer = local = routes = 0
    for s, idx in enumerate(idx_per_rank):
        idx = np.asarray(idx)
        valid = idx >= 0
        routes += int(valid.sum())
        dest = np.where(valid, idx // e_local, -1)
        for d in range(num_ranks):
            hit = int((dest == d).any(axis=1).sum())
            if d == s:
                local += hit
            else:
                peer += hit
    return peer, local, routes


def quantize_f32_g128(x, c448):
    """SEMANTICS.md fp8 f32_g128 quantization of bf16 x [T, H] with torch ops.

    c448 must be a tensor holding 448.0 on x's device: tensor/tensor division is IEEE division, while a
    Python scalar (or a CPU scalar next to a CUDA tensor) goes through a reciprocal and changes ~0.1% of codes.
    Returns (q float8_e4m3fn [T, H], scales float32 [T, H/128]).
    """
    import torch

    t, h = x.shape
    xf = x.float().view(t, h // SCALE_GROUP, SCALE_GROUP)
    amax = xf.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    scales = amax / c448
    mul = c448 / amax
    q = (xf * mul.unsqueeze(-1)).to(torch.float8_e4m3fn).view(t, h)
    return q, scales


# ----------------------------------------------------------------------------------------------------------------
# Timing


class Timer:
    """CUDA events on a GPU, perf_counter on the CPU. elapsed_us() after stop()."""

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.torch = torch
        if self.cuda:
            self.ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]

    def start(self):
        if self.cuda:
            self.ev[0].record()
        else:
            self.t0 = time.perf_counter()

    def stop(self):
        if self.cuda:
            self.ev[1].record()
        else:
            self.t1 = time.perf_counter()

    def elapsed_us(self) -> float:
        if self.cuda:
            self.ev[1].synchronize()
            return self.ev[0].elapsed_time(self.ev[1]) * 1e3
        return (self.t1 - self.t0) * 1e6


class L2Flush:
    """Writes a buffer larger than L2 (256 MB by default on a GPU) so the next iteration starts cold."""

    def __init__(self, device, nbytes: int = 256 << 20):
        import torch

        self.buf = None
        if device.type == "cuda" and nbytes > 0:
            self.buf = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def __call__(self):
        if self.buf is not None:
            self.buf.fill_(1)


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stats(us: list[float]) -> dict:
    return {
        "median_us": statistics.median(us),
        "mean_us": statistics.fmean(us),
        "min_us": min(us),
        "max_us": max(us),
        "iters": len(us),
    }


def hbm_copy_bandwidth(device, nbytes: int = 1 << 30, iters: int = 20) -> dict:
    """dst.copy_(src) of nbytes; bandwidth counts read + write (2 * nbytes) over the median time."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    timer = Timer(device)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    us = []
    for _ in range(iters):
        timer.start()
        dst.copy_(src)
        timer.stop()
        us.append(timer.elapsed_us())
    st = stats(us)
    st["bytes"] = 2 * src.numel() * 4
    st["gbps"] = st["bytes"] / (st["median_us"] * 1e3)
    del src, dst
    return st


def fmt_gbps(nbytes: float, us: float) -> str:
    return f"{nbytes / (us * 1e3):9.1f}" if us > 0 else "      n/a"


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()})"


@dataclass
class Shape:
    name: str
    tokens: int


def phases_from(tokens_arg: str) -> list[Shape]:
    """'128,4096' -> decode T=128, prefill T=4096; other counts are named t<T>."""
    out = []
    for part in tokens_arg.split(","):
        t = int(part)
        if t < 0:
            raise SystemExit(f"--tokens: {t} is negative")
        name = {128: "decode", 4096: "prefill"}.get(t, f"t{t}")
        out.append(Shape(name, t))
    return out
