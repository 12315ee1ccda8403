"""The routing generator of `elasticep bench` (tools/inputs.cpp), ported to numpy bit for bit.

splitmix64 streams per (seed, rank, purpose); expert popularity ~ 1/(i+1)^skew over a seeded
permutation; K distinct experts per token drawn by Efraimidis-Spirakis keys (the K smallest
-log(u)/popularity); weights 0.05 + U[0,1) normalised per token in float32. The same seed gives the
same topk_idx and topk_weights as the C++ bench, so `python -m elasticep.bench` and the baselines in
bench/ move the same messages and bytes as `elasticep bench` for the same options. numpy only.
"""
from __future__ import annotations

import math

import numpy as np

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
STREAM_MUL = 0xD1B54A32D192ED03
K_EXPERTS, K_X, K_ROUTES, K_WEIGHTS = 1, 2, 3, 4  # the streams of tools/inputs.cpp


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
