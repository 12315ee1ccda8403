"""A generated matrix of scenarios, every output compared bit for bit with the numpy oracle in
oracle.py (written from SEMANTICS.md, independent of the library)."""

import numpy as np
import pytest

import oracle as O
from conftest import ep, run_ranks

# (name, R, E, K, H, C, payload, fmt, options)
SCENARIOS = [
    ("bf16_contig", 2, 8, 2, 128, 6, "bf16", "f32_g128", {}),
    ("bf16_contig_align8_int32", 3, 9, 3, 264, 5, "bf16", "f32_g128", dict(alignment=8, idx=np.int32)),
    ("bf16_graph_mode", 2, 6, 4, 64, 4, "bf16", "f32_g128", dict(host_sync=False, alignment=4)),
    ("bf16_masked_bias", 4, 8, 3, 96, 5, "bf16", "f32_g128", dict(layout="masked", bias=True)),
    ("bf16_unweighted_zero_pad", 2, 4, 2, 40, 7, "bf16", "f32_g128", dict(weighted=False, zero_padding=True,
                                                                           alignment=3)),
    ("bf16_one_hot_expert", 3, 6, 2, 128, 6, "bf16", "f32_g128", dict(hot=True)),
    ("bf16_all_dropped", 2, 4, 2, 64, 3, "bf16", "f32_g128", dict(drop=1.0)),
    ("bf16_K1_E_eq_R", 4, 4, 1, 32, 6, "bf16", "f32_g128", {}),
    ("fp8_f32_contig", 2, 8, 4, 256, 6, "fp8", "f32_g128", {}),
    ("fp8_f32_masked_mn", 3, 6, 2, 384, 4, "fp8", "f32_g128", dict(layout="masked", mn_major=True)),
    ("fp8_f32_contig_mn_align", 2, 4, 3, 128, 5, "fp8", "f32_g128", dict(mn_major=True, alignment=4,
                                                                           zero_padding=True)),
    ("fp8_f32_prequantized", 2, 8, 2, 256, 4, "fp8", "f32_g128", dict(prequantized=True)),
    ("fp8_ue8m0_g128", 2, 8, 3, 640, 4, "fp8", "ue8m0_g128", {}),
    ("fp8_ue8m0_g32_masked", 3, 9, 2, 160, 4, "fp8", "ue8m0_g32", dict(layout="masked", bias=True)),
    ("fp8_ue8m0_graph_mode", 2, 4, 2, 256, 3, "fp8", "ue8m0_g128", dict(host_sync=False, alignment=2)),
]


def make_case(R, E, K, H, C, payload, fmt, opt, seed):
    rng = np.random.default_rng(seed)
    case = O.Case(R, E, K, H, C, payload, fmt)
    for s in range(R):
        # token counts: 0 on the last rank of wider groups, C on rank 0, random otherwise
        T = C if s == 0 else (0 if (s == R - 1 and R > 2) else int(rng.integers(0, C + 1)))
        mag = np.exp(rng.normal(0, 2, size=(T, 1)))
        xf = (rng.standard_normal((T, H)) * mag).astype(np.float32)
        if T and H >= 64:
            xf[0, : H // 2] = 0.0  # amax floor (1e-4) for whole groups
        if T >= 2:
            # amax / 448 an exact power of two (ue8m0 must not round the exponent up then)
            xf[1, : min(H, 128)] = rng.uniform(-1, 1, min(H, 128))
            xf[1, 0] = 224.0
        x = O.f32_to_bf16(xf)
        idx = np.full((T, K), -1, np.int64)
        for t in range(T):
            idx[t] = rng.permutation(E)[:K]
            if opt.get("hot"):
                idx[t, 0] = 1  # every token routes to expert 1
                others = [e for e in rng.permutation(E) if e != 1][: K - 1]
                idx[t, 1:] = others
        drop = opt.get("drop", 0.15)
        idx[rng.random((T, K)) < drop] = -1
        w = rng.standard_normal((T, K)).astype(np.float32) if opt.get("weighted", True) else None
        inp = dict(x=x, idx=idx.astype(opt.get("idx", np.int64)), w=w, scales=None)
        if opt.get("prequantized"):
            inp["x"], inp["scales"] = O.quantize(x, fmt)
        if w is None:
            inp["w_dispatch"] = rng.standard_normal((T, K)).astype(np.float32)  # carried, unused (unweighted)
            inp["w_sent"] = inp["w_dispatch"]
        case.ranks.append(inp)
    return case


@pytest.mark.parametrize("name,R,E,K,H,C,payload,fmt,opt", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_matrix(name, R, E, K, H, C, payload, fmt, opt):
    layout = opt.get("layout", "contiguous")
    A = opt.get("alignment", 1)
    host_sync = opt.get("host_sync", True)
    zero_padding = opt.get("zero_padding", False)
    mn = opt.get("mn_major", False)
    weighted = opt.get("weighted", True)
    case = make_case(R, E, K, H, C, payload, fmt, opt, seed=hash(name) % 1000)
    ys_rng = np.random.default_rng(7)
    ys = []
    exps = [O.dispatch(case, d, layout, A, host_sync) for d in range(R)]
    for d in range(R):
        shape = (exps[d]["rows"], H) if layout == "contiguous" else (E // R, R * C, H)
        ys.append(O.f32_to_bf16(ys_rng.standard_normal(shape).astype(np.float32)))
    biases = [O.f32_to_bf16(ys_rng.standard_normal((case.ranks[s]["x"].shape[0], H)).astype(np.float32))
              if opt.get("bias") else None for s in range(R)]

    def body(r, g):
        b = ep.Buffer(g, num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=C, payload=payload,
                      scale_format=fmt, timeout=20.0, backend="cpu")
        inp = case.ranks[r]
        w = inp["w"] if inp["w"] is not None else inp["w_dispatch"]
        d = b.dispatch(inp["x"], inp["idx"], w, layout=layout, expert_alignment=A, host_sync=host_sync,
                       zero_padding=zero_padding, scales=inp["scales"], scales_mn_major=mn)
        got = {k: (None if getattr(d, k) is None else np.array(getattr(d, k))) for k in
               ("recv_x", "recv_scales", "recv_weights", "recv_src", "m_indices", "counts", "offsets", "masked_m")}
        got["num_rows"] = d.num_rows
        got["out"] = np.array(b.combine(ys[r], d.handle, weighted=weighted, bias=biases[r]))
        return got

    results = run_ranks(R, body)
    for d in range(R):
        got, exp = results[d], exps[d]
        np.testing.assert_array_equal(got["counts"], exp["counts"], err_msg="rank %d counts" % d)
        El = E // R
        if layout == "contiguous":
            np.testing.assert_array_equal(got["offsets"], exp["offsets"])
            assert got["num_rows"] == exp["num_rows"]
            assert got["recv_x"].shape == (exp["rows"], H)
            assert got["masked_m"] is None
            # padding defaults: every row not written is padding
            real = np.zeros(exp["rows"], bool)
        else:
            np.testing.assert_array_equal(got["masked_m"], exp["counts"])
            assert got["recv_x"].shape == (El, R * C, H) and got["m_indices"] is None and got["offsets"] is None
            real = np.zeros((El, R * C), bool)
        for row, xbits, sc, wt, src, l in O.expected_rows(case, exp, d):
            real[row] = True
            np.testing.assert_array_equal(got["recv_x"][row], xbits, err_msg="rank %d row %s data" % (d, row))
            assert got["recv_weights"][row].view(np.uint32) == np.float32(wt).view(np.uint32)
            assert got["recv_src"][row] == src
            if layout == "contiguous":
                assert got["m_indices"][row] == l
            if payload == "fp8":
                np.testing.assert_array_equal(got["recv_scales"][row].view(np.uint32),
                                              np.asarray(sc).view(np.uint32), err_msg="rank %d row %s scales"
                                              % (d, row))
        if payload == "fp8":
            cols = O.scale_columns(fmt, H)
            assert got["recv_scales"].shape == got["recv_x"].shape[:-1] + (cols,)
        if layout == "contiguous":
            pad = ~real
            assert (got["m_indices"][pad] == -1).all() and (got["recv_src"][pad] == -1).all()
            assert (got["recv_weights"][pad] == 0).all()
            if zero_padding:
                assert (got["recv_x"][pad] == 0).all()
                if payload == "fp8":
                    assert (got["recv_scales"][pad] == 0).all()
            if not host_sync:
                assert got["offsets"][-1] == exp["m"]
        elif zero_padding:
            assert (got["recv_x"][~real] == 0).all()
        # combine
        expect_out = O.combine(case, d, ys, exps, weighted=weighted, bias=biases[d])
        np.testing.assert_array_equal(got["out"], expect_out, err_msg="rank %d combine" % d)


def test_oracle_self_check_e4m3_and_fmaf():
    """The oracle's own building blocks against values known independently."""
    vals = np.array([0.0, 1.0, -1.0, 448.0, 500.0, -1000.0, 2.0 ** -9, 2.0 ** -10, 0.3, 17.0, 2.0 ** -6],
                    np.float32)
    bits = O.e4m3_encode(vals)
    assert bits.tolist() == [0x00, 0x38, 0xB8, 0x7E, 0x7E, 0xFE, 0x01, 0x00, 0x2A, 0x58, 0x08]
    assert O.e4m3_decode(bits).tolist()[:4] == [0.0, 1.0, -1.0, 448.0]
    mld = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(3)
    v = (rng.standard_normal(20000) * np.exp(rng.normal(0, 4, 20000))).astype(np.float32)
    v = v[np.abs(v) < 440]
    np.testing.assert_array_equal(O.e4m3_encode(v), v.astype(mld.float8_e4m3fn).view(np.uint8))
    # fmaf: exact value 1 + 2^-24 + 2^-70 sits just above a float32 midpoint; a float64 sum loses the
    # 2^-70 and a plain round-to-even would give 1.0. The right answer is 1 + 2^-23.
    a = np.float32(-(2.0 ** -24) * (1 + 2.0 ** -23))
    b = np.float32(1 - 2.0 ** -23)
    c = np.float32(1 + 2.0 ** -23)
    assert np.float32(np.float64(a) * np.float64(b) + np.float64(c)) == np.float32(1.0)  # the trap
    assert O.fmaf(a, b, c) == np.float32(1 + 2.0 ** -23)
    assert O.fmaf(np.float32(3), np.float32(5), np.float32(7)) == np.float32(22)
