"""The hand-checkable case: R=2, E=4 (2 per rank), K=2, H=128, every expected value worked out by hand.

rank 0: t0 -> experts (1, 2) weights (0.5, 0.25), x = 1.0
        t1 -> experts (3, -1) weights (1.0, 0),  x = 2.0
rank 1: t0 -> experts (0, 1) weights (2.0, 1.0), x = 3.0
Rank 0 holds experts 0, 1; rank 1 holds 2, 3. Capacity C = 4, so recv_src = s * 4 + t.
"""

import numpy as np
import pytest

from conftest import ep, run_ranks

H = 128
ONE, TWO, THREE = 0x3F80, 0x4000, 0x4040  # bf16 bits of 1.0, 2.0, 3.0
BF16 = {0.75: 0x3F40, 1.0: 0x3F80, 2.0: 0x4000, 6.0: 0x40C0, 9.0: 0x4110, 2.5: 0x4020, 9.5: 0x4118, 1.25: 0x3FA0}


def inputs(rank):
    if rank == 0:
        x = np.array([[ONE] * H, [TWO] * H], np.uint16)
        idx = np.array([[1, 2], [3, -1]], np.int64)
        w = np.array([[0.5, 0.25], [1.0, 0.0]], np.float32)
    else:
        x = np.array([[THREE] * H], np.uint16)
        idx = np.array([[0, 1]], np.int32)
        w = np.array([[2.0, 1.0]], np.float32)
    return x, idx, w


def make(group, **kw):
    return ep.Buffer(group, num_experts=4, num_topk=2, hidden=H, max_tokens_per_rank=4, timeout=10.0, backend="cpu",
                     **kw)


def test_contiguous_alignment_1_and_weighted_combine():
    def body(r, g):
        b = make(g)
        x, idx, w = inputs(r)
        d = b.dispatch(x, idx, w)
        got = dict(x=d.recv_x[:, 0].tolist(), full=bool((d.recv_x == d.recv_x[:, :1]).all()),
                   src=d.recv_src.tolist(), mi=d.m_indices.tolist(), w=d.recv_weights.tolist(),
                   counts=d.counts.tolist(), offsets=d.offsets.tolist(), m=d.num_rows, layout=d.layout,
                   scales=d.recv_scales, masked=d.masked_m)
        out = b.combine(d.recv_x, d.handle)  # identity experts
        got["out"] = out[:, 0].tolist()
        got["out_full"] = bool((out == out[:, :1]).all())
        got["out_type"] = (type(out), out.dtype, out.shape)
        return got

    r0, r1 = run_ranks(2, body)
    assert r0["x"] == [THREE, ONE, THREE] and r0["full"]
    assert r0["src"] == [4, 0, 4] and r0["mi"] == [0, 1, 1] and r0["w"] == [2.0, 0.5, 1.0]
    assert r0["counts"] == [1, 2] and r0["offsets"] == [0, 1, 3] and r0["m"] == 3
    assert r0["layout"] == "contiguous" and r0["scales"] is None and r0["masked"] is None
    assert r1["x"] == [ONE, TWO] and r1["src"] == [0, 1] and r1["mi"] == [0, 1] and r1["w"] == [0.25, 1.0]
    assert r1["counts"] == [1, 1] and r1["offsets"] == [0, 1, 2] and r1["m"] == 2
    # rank 0: t0 = 0.5*1 (rank 0) + 0.25*1 (rank 1) = 0.75; t1 = 1.0*2 = 2; rank 1: t0 = 2*3 + 1*3 = 9
    assert r0["out"] == [BF16[0.75], BF16[2.0]] and r0["out_full"]
    assert r1["out"] == [BF16[9.0]] and r1["out_full"]
    assert r0["out_type"] == (np.ndarray, np.uint16, (2, H))


def test_contiguous_alignment_4_unweighted_with_bias_and_zero_padding():
    def body(r, g):
        b = make(g)
        x, idx, w = inputs(r)
        d = b.dispatch(x, idx, w, expert_alignment=4, zero_padding=True)
        rows = d.recv_x[:, 0].tolist()
        res = dict(rows=rows, mi=d.m_indices.tolist(), src=d.recv_src.tolist(), w=d.recv_weights.tolist(),
                   offsets=d.offsets.tolist(), m=d.num_rows)
        bias = np.full((x.shape[0], H), 0x3F00, np.uint16)  # 0.5
        out = b.combine(d.recv_x, d.handle, weighted=False, bias=bias)
        res["out"] = out[:, 0].tolist()
        return res

    r0, r1 = run_ranks(2, body)
    assert r0["offsets"] == [0, 4, 8] and r0["m"] == 8
    assert r0["rows"] == [THREE, 0, 0, 0, ONE, THREE, 0, 0]
    assert r0["mi"] == [0, -1, -1, -1, 1, 1, -1, -1]
    assert r0["src"] == [4, -1, -1, -1, 0, 4, -1, -1]
    assert r0["w"] == [2.0, 0, 0, 0, 0.5, 1.0, 0, 0]
    assert r1["offsets"] == [0, 4, 8] and r1["rows"] == [ONE, 0, 0, 0, TWO, 0, 0, 0]
    # unweighted + bias 0.5: rank 0 t0 = 0.5 + 1 + 1 = 2.5, t1 = 0.5 + 2 = 2.5; rank 1 t0 = 0.5 + 3 + 3 = 6.5
    assert r0["out"] == [BF16[2.5], BF16[2.5]]
    assert r1["out"] == [0x40D0]  # 6.5


def test_masked_layout():
    def body(r, g):
        b = make(g)
        x, idx, w = inputs(r)
        d = b.dispatch(x, idx, w, layout="masked")
        res = dict(shape=d.recv_x.shape, mm=d.masked_m.tolist(), counts=d.counts.tolist(), mi=d.m_indices,
                   off=d.offsets, num_rows=d.num_rows, layout=d.layout, handle_layout=d.handle.layout,
                   x=[d.recv_x[l, :n, 0].tolist() for l, n in enumerate(d.masked_m.tolist())],
                   src=[d.recv_src[l, :n].tolist() for l, n in enumerate(d.masked_m.tolist())],
                   w=[d.recv_weights[l, :n].tolist() for l, n in enumerate(d.masked_m.tolist())])
        # expert l's output = 2 * input: a real "expert" computation, exact in bf16
        y = (d.recv_x.astype(np.uint32) + (1 << 7)).astype(np.uint16)  # +1 in the exponent = *2 (normal values)
        out = b.combine(y, d.handle)
        res["out"] = out[:, 0].tolist()
        return res

    r0, r1 = run_ranks(2, body)
    assert r0["shape"] == (2, 8, H) and r0["layout"] == "masked" and r0["handle_layout"] == "masked"
    assert r0["mi"] is None and r0["off"] is None and r0["num_rows"] == -1
    assert r0["mm"] == [1, 2] and r0["counts"] == [1, 2] and r1["mm"] == [1, 1]
    assert r0["x"] == [[THREE], [ONE, THREE]] and r1["x"] == [[ONE], [TWO]]
    assert r0["src"] == [[4], [0, 4]] and r0["w"] == [[2.0], [0.5, 1.0]]
    # doubled: rank 0 t0 = 0.5*2 + 0.25*2 = 1.5; t1 = 1*4 = 4; rank 1 t0 = 2*6 + 1*6 = 18
    assert r0["out"] == [0x3FC0, 0x4080] and r1["out"] == [0x4190]


def test_expert_load_counts_rows():
    def body(r, g):
        b = make(g)
        x, idx, w = inputs(r)
        for _ in range(2):
            d = b.dispatch(x, idx, w)
            b.combine(d.recv_x, d.handle)
        load = b.expert_load().tolist()
        b.reset_expert_load()
        return load, b.expert_load().tolist()

    (l0, z0), (l1, z1) = run_ranks(2, body)
    assert l0 == [2, 4] and l1 == [2, 2] and z0 == [0, 0] and z1 == [0, 0]


def test_ml_dtypes_bf16_in_and_out():
    mld = pytest.importorskip("ml_dtypes")

    def body(r, g):
        b = make(g)
        x, idx, w = inputs(r)
        xb = x.view(mld.bfloat16)
        d = b.dispatch(xb, idx, w)
        out = b.combine(d.recv_x, d.handle)
        return d.recv_x.dtype, out.dtype, out[:, 0].astype(np.float32).tolist()

    (dt0, ot0, o0), (_, _, o1) = run_ranks(2, body)
    assert dt0 == np.dtype(mld.bfloat16) and ot0 == np.dtype(mld.bfloat16)
    assert o0 == [0.75, 2.0] and o1 == [9.0]
