"""Shared pieces of the comparison baselines in bench/ (torch_emulation.py, nccl_alltoall.py).

- The routing generator of `elasticep bench` (elasticep/_routing.py, the numpy port of tools/inputs.cpp):
  the same seed gives the same topk_idx and topk_weights as the C++ bench, so the traffic (messages,
  bytes) of every baseline equals ElasticEP's.
- The wire message size and the message counts that define "bytes moved", from the library
  (include/elasticep/traffic.hpp through elasticep._C.count_traffic).
- The FP8 quantizer of SEMANTICS.md (f32_g128) written with torch ops.
- Timing helpers: CUDA events (or perf_counter on CPU), an L2 flush, and statistics.

Needs numpy, torch and the elasticep package.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

import numpy as np

# ElasticEP itself (pip install ., or PYTHONPATH=<build>/python): the routing generator and the byte
# accounting come from it, so the baselines move and count what `elasticep bench` moves and counts.
try:
    import elasticep
    from elasticep import _C
    from elasticep._routing import expert_popularity, make_routing  # noqa: F401 (used through bc.)
except ImportError as e:  # pragma: no cover - a setup error, said in one line
    raise SystemExit(f"bench/: the elasticep package is needed ({e}); pip install . or "
                     "PYTHONPATH=<build>/python") from None

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
SCALE_GROUP = 128


def round_up(v: int, a: int) -> int:
    return (v + a - 1) // a * a


def message_bytes(hidden: int, topk: int, payload_elem_bytes: int, scale_cols: int) -> int:
    """Bytes of one token on the wire, from the library (include/elasticep/traffic.hpp).

    fp8 (1-byte payload) here means f32_g128 scales, whose column count must be scale_cols."""
    payload = "fp8" if payload_elem_bytes == 1 else "bf16"
    if payload == "fp8" and scale_cols != elasticep.scale_columns("f32_g128", hidden):
        raise ValueError(f"scale_cols {scale_cols} is not that of f32_g128 at hidden {hidden}")
    none = np.zeros((0, topk), dtype=np.int64)
    params = {"num_experts": topk, "num_topk": topk, "hidden": hidden, "payload": payload, "scale_format": "f32_g128"}
    return _C.count_traffic(params, 1, 0, none, False)["message_bytes"]


def traffic(idx_per_rank, num_ranks: int, num_experts: int, hidden: int = 128, payload: str = "bf16"):
    """Messages (one per token and destination rank) to peers and to self, and routes, all ranks together:
    the library's count (include/elasticep/traffic.hpp), as `elasticep bench` reports it."""
    peer = local = routes = 0
    for s, idx in enumerate(idx_per_rank):
        idx = np.ascontiguousarray(np.asarray(idx), dtype=np.int64)
        params = {"num_experts": num_experts, "num_topk": idx.shape[1], "hidden": hidden, "payload": payload,
                  "scale_format": "f32_g128"}
        t = _C.count_traffic(params, num_ranks, s, idx, False)
        peer += t["peer_messages"]
        local += t["local_messages"]
        routes += t["routes"]
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
    """`--json [FILE]`: FILE, or stdout for "-"."""
    if path == "-":
        print(json.dumps(obj, indent=2))
        return
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def check_json_path(path) -> None:
    """Fails at start, not after the run, when `--json FILE` cannot be written."""
    if path and path != "-":
        try:
            open(path, "w").close()
        except OSError as e:
            raise SystemExit(f"--json {path}: cannot open it for writing ({e.strerror}); create its folder first")


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
