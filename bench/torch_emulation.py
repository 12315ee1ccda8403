#!/usr/bin/env python3
"""Baseline (a) of issue #3: ElasticEP's dispatch and combine (docs/SEMANTICS.md) written with plain torch ops,
R expert-parallel ranks emulated on one device, the way a user without this library would do it.

Dispatch, all ranks in one call:
  1. per source rank: fused FP8 quantization (f32_g128: amax per 1x128 group, scale = amax/448,
     q = e4m3(x * (448/amax)) with tensor/tensor division) straight into that rank's send rows;
  2. route expansion of topk_idx, a stable sort by (dest rank, local expert, source rank, token);
  3. per-expert counts, aligned segment starts, and one gather into the expert-contiguous layout of every
     destination rank (padding rows zero), or a scatter into the expert-masked slab [E_local, R*C, H].
     Outputs per destination rank: recv_x, recv_scales, m_indices, recv_weights, recv_src, counts, offsets
     (contiguous) or masked_m (masked).
Combine, per source rank: per route p = fma(w, y, p) in k order into the fp32 partial of (token, dest rank),
  partials rounded to bf16, then summed per token in order of first appearance, in fp32, rounded to bf16.

Timing: CUDA events around each phase after warm-up, an L2 flush (a 256 MB write) before every iteration,
median over iterations. GB/s counts the bytes ElasticEP's bench counts: messages (one per token and
destination rank) to other ranks times the wire message size (src/core/layout.hpp) for dispatch, times
H*2 for combine. Also measured: a plain HBM copy (read + write), the floor.

`--self-check` compares the emulation with a hand-computed case and with an independent loop-by-loop
oracle (numpy float32 scalars, no torch arithmetic) and exits non-zero on any difference.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402


class Config:
    def __init__(self, ranks, tokens, hidden, experts, topk, payload="fp8", alignment=1, layout="contiguous",
                 zero_padding=False, weighted=True, capacity=None):
        if experts % ranks:
            raise SystemExit(f"--experts {experts} is not a multiple of --ranks {ranks}")
        if payload == "fp8" and hidden % bc.SCALE_GROUP:
            raise SystemExit(f"--hidden {hidden} is not a multiple of {bc.SCALE_GROUP} (fp8 scale group)")
        if hidden % 8:
            raise SystemExit(f"--hidden {hidden} is not a multiple of 8")
        if not 1 <= topk <= min(32, experts):
            raise SystemExit(f"--topk {topk} must be in [1, min(32, experts)]")
        if alignment < 1:
            raise SystemExit("--alignment must be >= 1")
        self.ranks, self.tokens, self.hidden, self.experts, self.topk = ranks, tokens, hidden, experts, topk
        self.payload, self.alignment, self.layout, self.zero_padding = payload, alignment, layout, zero_padding
        self.weighted = weighted
        self.capacity = tokens if capacity is None else capacity
        self.e_local = experts // ranks
        self.fp8 = payload == "fp8"
        self.cols = hidden // bc.SCALE_GROUP if self.fp8 else 0
        self.msg_bytes = bc.message_bytes(hidden, topk, 1 if self.fp8 else 2, self.cols)
        self.slots = min(topk, ranks)  # distinct destination ranks a token can have


class Inputs:
    """Per source rank: x [T, H] bf16, topk_idx [T, K] int64, topk_weights [T, K] fp32 (or None), bias or None."""

    def __init__(self, x, idx, weights, bias=None):
        self.x, self.idx, self.weights, self.bias = x, idx, weights, bias


def make_inputs(cfg: Config, device, seed=1, skew=0.8, drop=0.0) -> Inputs:
    pop = bc.expert_popularity(cfg.experts, skew, seed)
    gen = torch.Generator(device=device)
    xs, idxs, ws = [], [], []
    for r in range(cfg.ranks):
        idx, w = bc.make_routing(r, cfg.tokens, cfg.experts, cfg.topk, skew=skew, drop=drop, seed=seed,
                                 weighted=cfg.weighted, popularity=pop)
        idxs.append(torch.from_numpy(idx).to(device))
        ws.append(torch.from_numpy(w).to(device) if w is not None else None)
        # roughly normal activations with about one outlier channel in 64 (as tools/inputs.cpp; other bits)
        gen.manual_seed(seed * 1000003 + r)
        x = torch.zeros(cfg.tokens, cfg.hidden, dtype=torch.float32, device=device)
        for _ in range(4):
            x += torch.rand(cfg.tokens, cfg.hidden, generator=gen, device=device)
        x -= 2.0
        ch = torch.arange(cfg.hidden, device=device, dtype=torch.int64)
        outlier = ((ch * 2654435761) & 0xFFFFFFFF) >> 26 == 0
        x[:, outlier] *= 16.0
        xs.append(x.to(torch.bfloat16))
    return Inputs(xs, idxs, ws)


class Handle:
    pass


class Emulation:
    def __init__(self, cfg: Config, device):
        self.cfg = cfg
        self.device = device
        self.c448 = torch.tensor(bc.E4M3_MAX, dtype=torch.float32, device=device)  # a device tensor: IEEE division

    # ------------------------------------------------------------------------------------------------ dispatch
    def dispatch(self, inp: Inputs):
        cfg, dev = self.cfg, self.device
        R, T, H, K, El, C, A = cfg.ranks, cfg.tokens, cfg.hidden, cfg.topk, cfg.e_local, cfg.capacity, cfg.alignment
        n_src = R * T
        # 1. Each source rank quantizes into its rows of the send staging; one extra zero row feeds padding.
        elem = 1 if cfg.fp8 else 2
        send_x = torch.empty(n_src + 1, H * elem, dtype=torch.uint8, device=dev)
        send_x[n_src].zero_()
        send_s = None
        if cfg.fp8:
            send_s = torch.empty(n_src + 1, cfg.cols, dtype=torch.float32, device=dev)
            send_s[n_src].zero_()
            q_view = send_x.view(torch.float8_e4m3fn)
            for s in range(R):
                x = inp.x[s]
                xf = x.float().view(T, cfg.cols, bc.SCALE_GROUP)
                amax = xf.abs().amax(dim=-1).clamp_min_(bc.AMAX_FLOOR)
                torch.div(amax, self.c448, out=send_s[s * T:(s + 1) * T])
                mul = torch.div(self.c448, amax)
                q_view[s * T:(s + 1) * T].view(T, cfg.cols, bc.SCALE_GROUP).copy_(xf.mul_(mul.unsqueeze(-1)))
        else:
            for s in range(R):
                send_x[s * T:(s + 1) * T].view(torch.bfloat16).copy_(inp.x[s])

        # 2. Route expansion and the stable sort by (dest rank, local expert, source rank, token).
        idx_all = torch.cat(inp.idx).view(-1)  # route id = (s * T + t) * K + k
        route = torch.nonzero(idx_all >= 0).squeeze(1)
        e = idx_all[route]
        tok = torch.div(route, K, rounding_mode="floor")  # s * T + t
        src_rank = torch.div(tok, T, rounding_mode="floor")
        src_id = src_rank * C + (tok - src_rank * T)  # s * C + t
        key = e * (R * C) + src_id
        order = torch.sort(key, stable=True).indices
        e_sorted = e[order]
        route_sorted = route[order]
        tok_sorted = tok[order]

        # 3. Counts, aligned starts, row positions.
        counts = torch.bincount(e, minlength=cfg.experts).to(torch.int64)  # [E], global expert = d*El + l
        first = torch.cumsum(counts, 0) - counts  # first sorted index of each expert
        rank_in_seg = torch.arange(route.numel(), device=dev) - first[e_sorted]
        weights_all = torch.cat(inp.weights).view(-1) if cfg.weighted else None
        h = Handle()
        h.n_routes = route.numel()
        if cfg.layout == "contiguous":
            aligned = (counts + (A - 1)) // A * A
            per_dest = aligned.view(R, El)
            starts = torch.cumsum(per_dest, 1) - per_dest  # start of l within dest d
            m_dest = per_dest.sum(1)
            base = torch.cumsum(m_dest, 0) - m_dest
            m_list = m_dest.tolist()  # host sync, exactly M rows per destination (as a user would)
            m_total = sum(m_list)
            pos = (base.view(R, 1) + starts).view(-1)[e_sorted] + rank_in_seg
            gather = torch.full((m_total,), n_src, dtype=torch.int64, device=dev)  # padding -> zero row
            gather[pos] = tok_sorted
            recv_x = send_x.index_select(0, gather)
            recv_scales = send_s.index_select(0, gather) if cfg.fp8 else None
            m_indices = torch.full((m_total,), -1, dtype=torch.int32, device=dev)
            m_indices[pos] = (e_sorted % El).to(torch.int32)
            recv_src = torch.full((m_total,), -1, dtype=torch.int32, device=dev)
            recv_src[pos] = src_id[order].to(torch.int32)
            recv_w = torch.zeros(m_total, dtype=torch.float32, device=dev)
            if cfg.weighted:
                recv_w[pos] = weights_all[route_sorted]
            offsets = torch.cat([torch.zeros(R, 1, dtype=torch.int64, device=dev), torch.cumsum(per_dest, 1)], 1)
            out = {
                "recv_x": recv_x, "recv_scales": recv_scales, "m_indices": m_indices, "recv_src": recv_src,
                "recv_weights": recv_w, "counts": counts.view(R, El).to(torch.int32),
                "offsets": offsets.to(torch.int32), "rows_per_dest": m_list,
            }
            h.rows = m_total
        else:  # masked slab [R dest][El][R*C] rows
            rc = R * C
            pos = e_sorted * rc + rank_in_seg
            rows = cfg.experts * rc
            alloc = torch.zeros if cfg.zero_padding else torch.empty
            recv_x = alloc(rows, H * elem, dtype=torch.uint8, device=dev)
            recv_x.index_copy_(0, pos, send_x.index_select(0, tok_sorted))
            recv_scales = None
            if cfg.fp8:
                recv_scales = alloc(rows, cfg.cols, dtype=torch.float32, device=dev)
                recv_scales.index_copy_(0, pos, send_s.index_select(0, tok_sorted))
            recv_src = torch.full((rows,), -1, dtype=torch.int32, device=dev)
            recv_src[pos] = src_id[order].to(torch.int32)
            recv_w = torch.zeros(rows, dtype=torch.float32, device=dev)
            if cfg.weighted:
                recv_w[pos] = weights_all[route_sorted]
            out = {
                "recv_x": recv_x, "recv_scales": recv_scales, "recv_src": recv_src, "recv_weights": recv_w,
                "masked_m": counts.view(R, El).to(torch.int32),
            }
            h.rows = rows

        # 4. The handle: per route (in (s, t, k) order) its row in the stacked outputs and its partial slot,
        #    the slot being the index of its destination among the token's distinct destinations, in order of
        #    first appearance in the top-k row.
        route_pos = torch.full((n_src * K,), -1, dtype=torch.int64, device=dev)
        route_pos[route_sorted] = pos
        dest = torch.where(idx_all >= 0, torch.div(idx_all, El, rounding_mode="floor"), -1).view(n_src, K)
        eq = (dest.unsqueeze(2) == dest.unsqueeze(1)) & (dest.unsqueeze(1) >= 0)  # [N, k, k']
        first_k = eq.to(torch.int8).argmax(dim=2)  # first k' with the same destination
        is_first = (first_k == torch.arange(K, device=dev)) & (dest >= 0)
        slot_of_first = torch.cumsum(is_first.to(torch.int64), 1) - 1
        slot = torch.gather(slot_of_first, 1, first_k)  # [N, K]
        h.route_pos = route_pos.view(R, T, K)
        h.slot = slot.view(R, T, K)
        h.weights = weights_all.view(R, T, K) if cfg.weighted else None
        h.slot_count = is_first.sum(1).view(R, T)
        # per route: the row of y it reads and the partial row [t * J + slot] it updates; dead routes (-1) read
        # row 0 and update a scratch row T * J, so no host sync is needed to drop them
        J = cfg.slots
        live = h.route_pos >= 0
        t_ids = torch.arange(T, device=dev).view(1, T, 1)
        h.yrow = torch.where(live, h.route_pos, 0)
        h.prow = torch.where(live, t_ids * J + h.slot, T * J)
        h.used = torch.arange(J, device=dev).view(1, 1, J) < h.slot_count.view(R, T, 1)  # [R, T, J]
        return out, h

    # ------------------------------------------------------------------------------------------------- combine
    def combine(self, y, h: Handle, weighted=True, bias=None):
        """y: bf16 [rows, H], every destination rank's rows stacked in dispatch order. Returns [R] of [T, H]."""
        cfg, dev = self.cfg, self.device
        R, T, H, J = cfg.ranks, cfg.tokens, cfg.hidden, cfg.slots
        if weighted and not cfg.weighted:
            raise ValueError("combine with route weights after a dispatch without weights")
        outs = []
        if h.n_routes == 0:  # nothing was routed: every token gets bias or 0
            return [(bias[s].float() if bias is not None else torch.zeros(T, H, device=dev)).to(torch.bfloat16)
                    for s in range(R)]
        for s in range(R):
            part = torch.full((T * J + 1, H), -0.0, dtype=torch.float32, device=dev)  # unused slots add -0.0: no-op
            part[:T * J].view(T, J, H).masked_fill_(h.used[s].unsqueeze(-1), 0.0)
            for k in range(cfg.topk):
                rows, prow = h.yrow[s, :, k], h.prow[s, :, k]
                yk = y.index_select(0, rows)
                pk = part.index_select(0, prow)
                if weighted:
                    pk.addcmul_(yk, h.weights[s, :, k].unsqueeze(1))  # p + w * y (a fused multiply-add on the GPU)
                else:
                    pk.add_(yk)
                part.index_copy_(0, prow, pk)  # dead routes all land on the scratch row
            partial = part[:T * J].to(torch.bfloat16).view(T, J, H)
            acc = bias[s].float() if bias is not None else torch.zeros(T, H, dtype=torch.float32, device=dev)
            for j in range(J):
                acc.add_(partial[:, j])
            outs.append(acc.to(torch.bfloat16))
        return outs


# ====================================================================================================== self-check

def f32(v):
    return np.float32(v)


def bf16_round(v: np.float32) -> np.float32:
    u = int(np.array([v], dtype=np.float32).view(np.uint32)[0])
    if (u & 0x7F800000) == 0x7F800000 and (u & 0x7FFFFF):
        return v
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return np.array([u & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]


def e4m3_round(v: float) -> float:
    """Round to nearest even E4M3 (bias 7, subnormal step 2^-9), saturating at 448."""
    if math.isnan(v):
        return v
    a = abs(v)
    if a >= 448.0:
        q = 448.0
    elif a < 2.0 ** -6:
        q = round(a / 2.0 ** -9) * 2.0 ** -9  # round() is half-to-even on exact halves
    else:
        ex = math.frexp(a)[1] - 1  # a in [2^ex, 2^(ex+1))
        step = 2.0 ** (ex - 3)
        q = round(a / step) * step
        q = min(q, 448.0)
    return math.copysign(q, v)


def oracle_quantize(row: np.ndarray):
    """row: float32 values of a bf16 row. Returns (q values as float, scales) with numpy float32 scalar math."""
    qs, scales = [], []
    for g in range(0, row.size, bc.SCALE_GROUP):
        grp = row[g:g + bc.SCALE_GROUP]
        amax = f32(0.0)
        for v in grp:
            amax = max(amax, f32(abs(v)))
        amax = max(amax, f32(bc.AMAX_FLOOR))
        scales.append(f32(amax / f32(448.0)))
        mul = f32(f32(448.0) / amax)
        qs.extend(e4m3_round(float(f32(v * mul))) for v in grp)
    return np.array(qs, dtype=np.float64), np.array(scales, dtype=np.float32)


def oracle_dispatch(cfg: Config, x, idx, w):
    """Loop-by-loop SEMANTICS dispatch. Returns per dest rank: list of rows (l or -1, src id, weight, data, scales)
    in layout order, and counts."""
    R, T, El, C, A = cfg.ranks, cfg.tokens, cfg.e_local, cfg.capacity, cfg.alignment
    quant = {}
    for s in range(R):
        for t in range(T):
            row = x[s][t]
            quant[(s, t)] = oracle_quantize(row) if cfg.fp8 else (row.astype(np.float64), None)
    per_dest = []
    for d in range(R):
        segs = []
        for l in range(El):
            rows = []
            for s in range(R):
                for t in range(T):
                    for k in range(cfg.topk):
                        if idx[s][t][k] == d * El + l:
                            rows.append((l, s * C + t, float(w[s][t][k]) if w is not None else 0.0, quant[(s, t)]))
            segs.append(rows)
        per_dest.append(segs)
    return per_dest


def check_equal(name, got, want, failures):
    got = np.asarray(got)
    want = np.asarray(want)
    if got.shape != want.shape:
        failures.append(f"{name}: shape {got.shape} != {want.shape}")
        return
    bad = ~((got == want) | (np.isnan(got) & np.isnan(want)) if got.dtype.kind == "f" else (got == want))
    if got.dtype.kind == "f":
        bad |= (np.signbit(got) != np.signbit(want))
    if bad.any():
        i = np.argwhere(bad)[0]
        failures.append(f"{name}: {int(bad.sum())} differences, first at {tuple(i)}: got {got[tuple(i)]} "
                        f"want {want[tuple(i)]}")


def dispatch_outputs_for_dest(cfg, out, d):
    """Slice destination rank d's outputs out of the stacked emulation outputs (as numpy)."""
    H = cfg.hidden
    if cfg.layout == "contiguous":
        rows = out["rows_per_dest"]
        lo = sum(rows[:d])
        sl = slice(lo, lo + rows[d])
    else:
        rc = cfg.ranks * cfg.capacity
        sl = slice(d * cfg.e_local * rc, (d + 1) * cfg.e_local * rc)
    xb = out["recv_x"][sl].cpu()
    x = (xb.view(torch.float8_e4m3fn) if cfg.fp8 else xb.view(torch.bfloat16)).float().numpy().reshape(-1, H)
    sc = out["recv_scales"][sl].cpu().numpy() if cfg.fp8 else None
    res = {"x": x, "scales": sc, "src": out["recv_src"][sl].cpu().numpy(), "w": out["recv_weights"][sl].cpu().numpy()}
    if cfg.layout == "contiguous":
        res["m_indices"] = out["m_indices"][sl].cpu().numpy()
        res["counts"] = out["counts"][d].cpu().numpy()
        res["offsets"] = out["offsets"][d].cpu().numpy()
    else:
        res["masked_m"] = out["masked_m"][d].cpu().numpy()
    return res


def compare_dispatch(cfg, out, want, failures, tag):
    rc = cfg.ranks * cfg.capacity
    for d in range(cfg.ranks):
        got = dispatch_outputs_for_dest(cfg, out, d)
        counts = [len(seg) for seg in want[d]]
        if cfg.layout == "contiguous":
            starts = [0]
            for c in counts:
                starts.append(starts[-1] + bc.round_up(c, cfg.alignment))
            check_equal(f"{tag} dest {d} counts", got["counts"], counts, failures)
            check_equal(f"{tag} dest {d} offsets", got["offsets"], starts, failures)
            m = starts[-1]
            if got["x"].shape[0] != m:
                failures.append(f"{tag} dest {d}: {got['x'].shape[0]} rows, want {m}")
                continue
            mi = np.full(m, -1, np.int32)
            src = np.full(m, -1, np.int32)
            wt = np.zeros(m, np.float32)
            xs = np.zeros((m, cfg.hidden))
            sc = np.zeros((m, cfg.cols), np.float32)
            for l, seg in enumerate(want[d]):
                for i, (ll, sid, wv, (qv, sv)) in enumerate(seg):
                    r = starts[l] + i
                    mi[r], src[r], wt[r], xs[r] = ll, sid, wv, qv
                    if cfg.fp8:
                        sc[r] = sv
            check_equal(f"{tag} dest {d} m_indices", got["m_indices"], mi, failures)
            real = mi >= 0
        else:
            check_equal(f"{tag} dest {d} masked_m", got["masked_m"], counts, failures)
            n = cfg.e_local * rc
            src = np.full(n, -1, np.int32)
            wt = np.zeros(n, np.float32)
            xs = np.zeros((n, cfg.hidden))
            sc = np.zeros((n, cfg.cols), np.float32)
            real = np.zeros(n, bool)
            for l, seg in enumerate(want[d]):
                for i, (ll, sid, wv, (qv, sv)) in enumerate(seg):
                    r = l * rc + i
                    src[r], wt[r], xs[r], real[r] = sid, wv, qv, True
                    if cfg.fp8:
                        sc[r] = sv
        check_equal(f"{tag} dest {d} recv_src", got["src"], src, failures)
        check_equal(f"{tag} dest {d} recv_weights", got["w"], wt, failures)
        keep = real if (cfg.layout == "masked" and not cfg.zero_padding) else np.ones_like(real)
        check_equal(f"{tag} dest {d} recv_x", got["x"][keep], xs[keep], failures)
        if cfg.fp8:
            check_equal(f"{tag} dest {d} recv_scales", got["scales"][keep], sc[keep], failures)


def oracle_combine(cfg, idx, w, y_of_route, weighted, bias=None):
    """y_of_route(s, t, k) -> float32 row. Returns [R] of float32 [T, H] (bf16 values)."""
    outs = []
    for s in range(cfg.ranks):
        o = np.zeros((cfg.tokens, cfg.hidden), np.float32)
        for t in range(cfg.tokens):
            dests = []
            for k in range(cfg.topk):
                if idx[s][t][k] >= 0 and idx[s][t][k] // cfg.e_local not in dests:
                    dests.append(idx[s][t][k] // cfg.e_local)
            for hh in range(cfg.hidden):
                partials = []
                for d in dests:
                    p = f32(0.0)
                    for k in range(cfg.topk):
                        if idx[s][t][k] >= 0 and idx[s][t][k] // cfg.e_local == d:
                            wk = np.float64(w[s][t][k]) if weighted else 1.0
                            # fmaf; exact here: the check's values keep every product and sum exact in fp32
                            p = f32(wk * np.float64(y_of_route(s, t, k)[hh]) + np.float64(p))
                    partials.append(bf16_round(p))
                acc = f32(bias[s][t][hh]) if bias is not None else f32(0.0)
                for pj in partials:
                    acc = f32(acc + pj)
                o[t, hh] = bf16_round(acc)
        outs.append(o)
    return outs


def y_from_dispatch(cfg, out, handle, value_of_route, device):
    """Builds y in dispatch row order from a per-route value function (rows located via the handle)."""
    y = torch.zeros(handle.rows, cfg.hidden, dtype=torch.float32)
    pos = handle.route_pos.cpu()
    for s in range(cfg.ranks):
        for t in range(cfg.tokens):
            for k in range(cfg.topk):
                p = int(pos[s, t, k])
                if p >= 0:
                    y[p] = torch.from_numpy(value_of_route(s, t, k))
    return y.to(torch.bfloat16).to(device)


def hand_case(device, failures):
    """R=2, E=4 (E_local=2), K=2, T=3, H=128, alignment 2: expected outputs written out by hand."""
    cfg = Config(ranks=2, tokens=3, hidden=128, experts=4, topk=2, payload="fp8", alignment=2)
    idx = [[[1, 2], [3, -1], [0, 1]], [[2, 0], [-1, -1], [3, 2]]]
    w = [[[0.5, 0.5], [1.0, 0.0], [0.25, 0.75]], [[0.5, 0.5], [0.0, 0.0], [0.5, 0.5]]]
    xs = []
    for s in range(2):
        rows = []
        for t in range(3):
            row = np.full(128, float(s * 3 + t + 1), np.float32)
            row[0] = 448.0  # amax 448: scale 1, codes equal the values
            rows.append(row)
        xs.append(rows)
    xs[1][2] = np.full(128, 0.30078125, np.float32)  # bf16(0.3); amax 1: 0.30078125 * 448 = 134.75 -> 128
    xs[1][2][0], xs[1][2][1] = 1.0, 0.5  # 1.0 -> 448, 0.5 -> 224
    inp = Inputs([torch.tensor(np.array(r), dtype=torch.bfloat16, device=device) for r in xs],
                 [torch.tensor(i, dtype=torch.int64, device=device) for i in idx],
                 [torch.tensor(v, dtype=torch.float32, device=device) for v in w])
    emu = Emulation(cfg, device)
    out, handle = emu.dispatch(inp)

    def row_of(s, t):
        if (s, t) == (1, 2):
            return [448.0, 224.0] + [128.0] * 126
        return [448.0] + [float(s * 3 + t + 1)] * 127

    zero = [0.0] * 128
    one_over_448 = float(np.float32(1.0) / np.float32(448.0))
    # dest 0: expert 0 <- (0,2) (1,0); expert 1 <- (0,0) (0,2). dest 1: expert 2 <- (0,0) (1,0) (1,2) + pad;
    # expert 3 <- (0,1) (1,2).
    want = {
        0: dict(counts=[2, 2], offsets=[0, 2, 4], m_indices=[0, 0, 1, 1], src=[2, 3, 0, 2],
                w=[0.25, 0.5, 0.5, 0.75], x=[row_of(0, 2), row_of(1, 0), row_of(0, 0), row_of(0, 2)],
                scales=[1.0, 1.0, 1.0, 1.0]),
        1: dict(counts=[3, 2], offsets=[0, 4, 6], m_indices=[0, 0, 0, -1, 1, 1], src=[0, 3, 5, -1, 1, 5],
                w=[0.5, 0.5, 0.5, 0.0, 1.0, 0.5],
                x=[row_of(0, 0), row_of(1, 0), row_of(1, 2), zero, row_of(0, 1), row_of(1, 2)],
                scales=[1.0, 1.0, one_over_448, 0.0, 1.0, one_over_448]),
    }
    for d in range(2):
        got = dispatch_outputs_for_dest(cfg, out, d)
        wd = want[d]
        check_equal(f"hand dest {d} counts", got["counts"], wd["counts"], failures)
        check_equal(f"hand dest {d} offsets", got["offsets"], wd["offsets"], failures)
        check_equal(f"hand dest {d} m_indices", got["m_indices"], wd["m_indices"], failures)
        check_equal(f"hand dest {d} recv_src", got["src"], wd["src"], failures)
        check_equal(f"hand dest {d} recv_weights", got["w"], np.array(wd["w"], np.float32), failures)
        check_equal(f"hand dest {d} recv_x", got["x"], np.array(wd["x"], np.float32), failures)
        check_equal(f"hand dest {d} recv_scales", got["scales"][:, 0], np.array(wd["scales"], np.float32), failures)

    # Combine by hand: R=2, E=4, K=3, T=1. Rank 0's token goes to d0, d1, d0 with y = 1, 2^-8, 2^-8 (w = 1):
    # its d0 partial is bf16(1 + 2^-8) = 1 (tie to even), plus d1's 2^-8 gives bf16(1 + 2^-8) = 1. Summing all
    # three routes in fp32 first would give 1 + 2^-7 = 1.0078125. Rank 1's token: one route, y = 3, w = 0.5.
    cfg = Config(ranks=2, tokens=1, hidden=128, experts=4, topk=3, payload="bf16")
    idx = [[[0, 2, 1]], [[3, -1, -1]]]
    w = [[[1.0, 1.0, 1.0]], [[0.5, 0.0, 0.0]]]
    inp = Inputs([torch.ones(1, 128, dtype=torch.bfloat16, device=device) for _ in range(2)],
                 [torch.tensor(i, dtype=torch.int64, device=device) for i in idx],
                 [torch.tensor(v, dtype=torch.float32, device=device) for v in w])
    emu = Emulation(cfg, device)
    out, handle = emu.dispatch(inp)
    vals = {(0, 0, 0): 1.0, (0, 0, 1): 2.0 ** -8, (0, 0, 2): 2.0 ** -8, (1, 0, 0): 3.0}
    y = y_from_dispatch(cfg, out, handle, lambda s, t, k: np.full(128, vals[(s, t, k)], np.float32), device)
    outs = emu.combine(y, handle, weighted=True)
    check_equal("hand combine rank 0", outs[0].float().cpu().numpy(), np.full((1, 128), 1.0, np.float32), failures)
    check_equal("hand combine rank 1", outs[1].float().cpu().numpy(), np.full((1, 128), 1.5, np.float32), failures)


def random_case(device, failures, layout, payload, alignment, zero_padding, seed):
    """Random routing (with dropped routes) checked against the loop-by-loop oracle."""
    cfg = Config(ranks=4, tokens=5, hidden=256, experts=8, topk=3, payload=payload, alignment=alignment,
                 layout=layout, zero_padding=zero_padding)
    inp = make_inputs(cfg, torch.device("cpu"), seed=seed, skew=0.8, drop=0.2)
    rng = np.random.default_rng(seed)
    # weights that keep combine arithmetic exact (so the oracle needs no fma): powers of two
    ws = [torch.tensor(rng.choice([0.125, 0.25, 0.5, 1.0], size=(cfg.tokens, cfg.topk)), dtype=torch.float32)
          for _ in range(cfg.ranks)]
    inp.weights = ws
    x_np = [inp.x[s].float().numpy() for s in range(cfg.ranks)]
    idx_np = [inp.idx[s].numpy() for s in range(cfg.ranks)]
    w_np = [ws[s].numpy() for s in range(cfg.ranks)]
    dev_inp = Inputs([v.to(device) for v in inp.x], [v.to(device) for v in inp.idx], [v.to(device) for v in ws])
    emu = Emulation(cfg, device)
    out, handle = emu.dispatch(dev_inp)
    tag = f"random {layout} {payload} A={alignment} zp={int(zero_padding)} seed={seed}"
    compare_dispatch(cfg, out, oracle_dispatch(cfg, x_np, idx_np, w_np), failures, tag)
    # y per route: multiples of 2^-6 in (-4, 4), exact in bf16; with power-of-two weights every fp32 sum is exact
    yv = {}
    for s in range(cfg.ranks):
        for t in range(cfg.tokens):
            for k in range(cfg.topk):
                yv[(s, t, k)] = (rng.integers(-255, 256, size=cfg.hidden) * 2.0 ** -6).astype(np.float32)
    y = y_from_dispatch(cfg, out, handle, lambda s, t, k: yv[(s, t, k)], device)
    bias = [torch.tensor(rng.integers(-64, 64, size=(cfg.tokens, cfg.hidden)) * 2.0 ** -6, dtype=torch.bfloat16)
            for _ in range(cfg.ranks)]
    for weighted, use_bias in ((True, False), (False, True)):
        got = emu.combine(y, handle, weighted=weighted, bias=[b.to(device) for b in bias] if use_bias else None)
        want = oracle_combine(cfg, idx_np, w_np, lambda s, t, k: yv[(s, t, k)], weighted,
                              [b.float().numpy() for b in bias] if use_bias else None)
        for s in range(cfg.ranks):
            check_equal(f"{tag} combine w={int(weighted)} bias={int(use_bias)} rank {s}",
                        got[s].float().cpu().numpy(), want[s], failures)
    return int(sum(v.numel() for v in inp.idx) - sum(int((v < 0).sum()) for v in inp.idx))


def self_check(device) -> int:
    failures = []
    hand_case(device, failures)
    n = 0
    cases = [("contiguous", "fp8", 1, False), ("contiguous", "fp8", 4, False), ("contiguous", "bf16", 3, False),
             ("masked", "fp8", 1, False), ("masked", "bf16", 1, True)]
    for i, (layout, payload, a, zp) in enumerate(cases):
        n += random_case(device, failures, layout, payload, a, zp, seed=11 + i)
    if failures:
        for f in failures[:20]:
            print("FAIL", f)
        print(f"self-check FAILED on {device}: {len(failures)} mismatching outputs")
        return 1
    print(f"self-check passed on {device}: hand case (dispatch + combine) and {len(cases)} random cases "
          f"({n} routes) equal to the loop-by-loop oracle bit for bit")
    return 0


# ======================================================================================================= benchmark

def check_memory(cfg: Config, device):
    """Refuses shapes whose buffers cannot fit, naming the fix, instead of failing deep inside torch."""
    if device.type != "cuda":
        return
    R, T, H = cfg.ranks, cfg.tokens, cfg.hidden
    elem = 1 if cfg.fp8 else 2
    if cfg.layout == "masked":
        rows = cfg.experts * R * cfg.capacity
    else:
        rows = R * T * min(cfg.topk, cfg.e_local) + cfg.experts * (cfg.alignment - 1)
    need = rows * (H * elem + cfg.cols * 4 + 16) + rows * H * 2  # recv buffers + y of combine
    need += R * T * H * 8 + T * cfg.slots * H * 4 * 2  # inputs, staging, one rank's partials
    free, total = torch.cuda.mem_get_info(device)
    if need > 0.9 * free:
        raise SystemExit(f"{cfg.layout} layout with T={T} per rank needs about {need / 2**30:.1f} GiB, "
                         f"{free / 2**30:.1f} GiB free: lower --tokens (the masked slab is for decode) or --ranks")


def bench_phase(cfg: Config, device, args, shape_name):
    check_memory(cfg, device)
    inp = make_inputs(cfg, device, seed=args.seed, skew=args.skew, drop=args.drop)
    idx_np = [v.cpu().numpy() for v in inp.idx]
    peer, local, routes = bc.traffic(idx_np, cfg.ranks, cfg.experts)
    emu = Emulation(cfg, device)
    flush = bc.L2Flush(device, 0 if args.no_flush else 256 << 20)
    t_disp, t_comb = bc.Timer(device), bc.Timer(device)
    y = None
    d_us, c_us = [], []
    for it in range(args.warmup + args.iters):
        flush()
        bc.sync(device)
        t_disp.start()
        out, handle = emu.dispatch(inp)
        t_disp.stop()
        if y is None:  # stand-in expert outputs: the received rows as bf16 (made once, outside the timing)
            y = torch.randn(handle.rows, cfg.hidden, device=device, dtype=torch.bfloat16)
        del out
        flush()
        bc.sync(device)
        t_comb.start()
        outs = emu.combine(y, handle, weighted=cfg.weighted)
        t_comb.stop()
        if it >= args.warmup:
            d_us.append(t_disp.elapsed_us())
            c_us.append(t_comb.elapsed_us())
        else:
            bc.sync(device)
        del outs, handle
    d_bytes, c_bytes = peer * cfg.msg_bytes, peer * cfg.hidden * 2
    res = {"phase": shape_name, "tokens_per_rank": cfg.tokens, "peer_messages": peer, "local_messages": local,
           "routes": routes, "message_bytes": cfg.msg_bytes}
    for name, us, nbytes in (("dispatch", d_us, d_bytes), ("combine", c_us, c_bytes)):
        st = bc.stats(us)
        st["peer_bytes"] = nbytes
        st["total_bytes"] = (peer + local) * (cfg.msg_bytes if name == "dispatch" else cfg.hidden * 2)
        st["peer_gbps"] = nbytes / (st["median_us"] * 1e3)
        res[name] = st
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=8, help="emulated EP ranks (default 8)")
    ap.add_argument("--tokens", default="128,4096",
                    help="tokens per rank, comma-separated phases (default 128,4096 = decode,prefill)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--payload", choices=["bf16", "fp8"], default="fp8", help="dispatch payload (fp8 = f32_g128)")
    ap.add_argument("--layout", choices=["contiguous", "masked"], default="contiguous")
    ap.add_argument("--alignment", type=int, default=1, help="expert_alignment of the contiguous layout")
    ap.add_argument("--zero-padding", action="store_true", help="masked layout: zero the slab first")
    ap.add_argument("--no-weights", "--unweighted", dest="unweighted", action="store_true",
                    help="no route weights (combine sums)")
    ap.add_argument("--skew", type=float, default=0.8, help="expert popularity skew (as elasticep bench)")
    ap.add_argument("--drop", type=float, default=0.0, help="probability that a route is -1")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", "--iters", dest="iters", type=int, default=20, help="timed rounds (as elasticep bench)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-flush", action="store_true", help="skip the L2 flush between iterations")
    ap.add_argument("--no-hbm", action="store_true", help="skip the HBM copy measurement")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                    help="write the results as JSON to FILE (stdout without FILE)")
    ap.add_argument("--self-check", action="store_true", help="check the emulation against the oracle and exit")
    args = ap.parse_args(argv)
    bc.check_json_path(args.json)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if device.index is None:  # "cuda": the current device, made explicit (set_device needs an index)
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    if args.self_check:
        return self_check(device)

    print(f"torch emulation of ElasticEP dispatch/combine: {args.ranks} ranks on one device, {device_name(device)}, "
          f"torch {torch.__version__}")
    print(f"H={args.hidden} E={args.experts} K={args.topk} payload={args.payload} layout={args.layout} "
          f"A={args.alignment} skew={args.skew} seed={args.seed} iters={args.iters} warmup={args.warmup} "
          f"L2 flush={'off' if args.no_flush else 'on'}")
    report = {"bench": "torch_emulation", "device": device_name(device), "torch": torch.__version__,
              "ranks": args.ranks, "hidden": args.hidden, "experts": args.experts, "topk": args.topk,
              "payload": args.payload, "layout": args.layout, "alignment": args.alignment, "skew": args.skew,
              "seed": args.seed, "iters": args.iters, "warmup": args.warmup, "l2_flush": not args.no_flush,
              "phases": []}
    hbm = None
    if not args.no_hbm:
        hbm = bc.hbm_copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (64 << 20))
        report["hbm_copy"] = hbm
        print(f"HBM copy (read+write): {hbm['gbps']:.1f} GB/s  ({hbm['bytes'] / 2 / 2**20:.0f} MiB copied, "
              f"median {hbm['median_us']:.1f} us)")
    print(f"{'phase':8} {'T/rank':>6} {'op':8} {'median us':>10} {'min us':>10} {'peer MB':>9} {'GB/s':>9}"
          f"{'floor us':>10} {'x floor':>8}")
    for shape in bc.phases_from(args.tokens):
        cfg = Config(args.ranks, shape.tokens, args.hidden, args.experts, args.topk, args.payload, args.alignment,
                     args.layout, args.zero_padding, not args.unweighted)
        res = bench_phase(cfg, device, args, shape.name)
        for op in ("dispatch", "combine"):
            st = res[op]
            if hbm:
                # the floor: every peer byte read once and written once at the copy bandwidth
                st["hbm_floor_us"] = st["peer_bytes"] / (hbm["gbps"] * 1e3)
                st["x_floor"] = st["median_us"] / st["hbm_floor_us"] if st["hbm_floor_us"] > 0 else None
            floor = f"{st['hbm_floor_us']:10.1f}{st['x_floor']:8.1f}x" if hbm and st.get("x_floor") else ""
            print(f"{shape.name:8} {shape.tokens:6} {op:8} {st['median_us']:10.1f} {st['min_us']:10.1f} "
                  f"{st['peer_bytes'] / 1e6:9.2f} {st['peer_gbps']:9.1f}{floor}")
        report["phases"].append(res)
    if args.json:
        bc.write_json(args.json, report)
        if args.json != "-":
            print(f"wrote {args.json}")
    return 0


def device_name(device):
    return bc.device_name(device)


if __name__ == "__main__":
    sys.exit(main())
