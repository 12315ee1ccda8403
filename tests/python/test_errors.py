"""Every error path: bad dtype/shape/stride, capacity, invalid expert ids, handle misuse, timeouts,
configuration mistakes. Each raises the right exception class with the C++ code and message."""

import builtins

import numpy as np
import pytest

from conftest import ep, run_ranks, run_ranks_raw

H, K, E, C = 128, 2, 4, 4


def single(**kw):
    """A one-rank buffer: any error it raises is necessarily raised before communication."""
    g = ep.ThreadGroup(1, timeout=5.0)[0]
    args = dict(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=C, timeout=5.0, backend="cpu")
    args.update(kw)
    return ep.Buffer(g, **args)


def good(t=2):
    x = np.zeros((t, H), np.uint16)
    idx = np.tile(np.array([[0, 1]], np.int64), (t, 1))
    w = np.ones((t, K), np.float32)
    return x, idx, w


def test_exception_hierarchy():
    assert issubclass(ep.InvalidArgumentError, ValueError) and issubclass(ep.InvalidArgumentError, ep.Error)
    assert issubclass(ep.CapacityExceededError, ValueError) and issubclass(ep.CapacityExceededError, ep.Error)
    assert issubclass(ep.TimeoutError, builtins.TimeoutError) and issubclass(ep.TimeoutError, ep.Error)
    assert issubclass(ep.UnsupportedError, ep.Error)


@pytest.mark.parametrize("what,make,needle", [
    ("x fp32", lambda x, i, w: (x.astype(np.float32), i, w), "dispatch: x is fp32[2, 128] cpu but must be bf16"),
    ("x float16", lambda x, i, w: (x.view(np.float16), i, w), "dispatch: x has dtype float16 [2, 128]"),
    ("x float64", lambda x, i, w: (x.astype(np.float64), i, w), "dispatch: x has dtype float64"),
    ("x int32 bits", lambda x, i, w: (x.astype(np.int32), i, w), "dispatch: x is int32[2, 128] cpu but must be bf16"),
    ("idx fp32", lambda x, i, w: (x, i.astype(np.float32), w), "dispatch: topk_idx is fp32[2, 2] cpu but must be "
                                                               "int32 or int64"),
    ("idx uint16", lambda x, i, w: (x, i.astype(np.uint16), w), "dispatch: topk_idx has dtype uint16"),
    ("w float64", lambda x, i, w: (x, i, w.astype(np.float64)), "dispatch: topk_weights has dtype float64"),
    ("w int32", lambda x, i, w: (x, i, w.astype(np.int32)), "dispatch: topk_weights is int32[2, 2] cpu but must be "
                                                            "fp32"),
    ("x wide", lambda x, i, w: (np.zeros((2, H + 8), np.uint16), i, w), "dispatch: x is bf16[2, 136] cpu but must "
                                                                        "be [2, 128]"),
    ("x 1-D", lambda x, i, w: (np.zeros(H, np.uint16), i, w), "must be 2-D [num_tokens, hidden]"),
    ("idx K+1", lambda x, i, w: (x, np.zeros((2, K + 1), np.int64), w), "dispatch: topk_idx is int64[2, 3] cpu but "
                                                                         "must be [2, 2]"),
    ("w rows", lambda x, i, w: (x, i, w[:1]), "dispatch: topk_weights is fp32[1, 2] cpu but must be [2, 2]"),
    ("x strided", lambda x, i, w: (np.zeros((2, 2 * H), np.uint16)[:, ::2], i, w),
     "its last dimension must be contiguous (stride 1)"),
    ("idx strided", lambda x, i, w: (x, np.zeros((2, 2 * K), np.int64)[:, ::2], w),
     "dispatch: topk_idx is int64[2, 2] strides(4, 2) cpu: its last dimension must be contiguous"),
    ("fp8 x on bf16 buffer", lambda x, i, w: (np.zeros((2, H), np.uint8), i, w),
     "dispatch: x is fp8 but the buffer's payload is bf16"),
])
def test_bad_inputs_raise_before_communication(what, make, needle):
    b = single()
    x, idx, w = make(*good())
    with pytest.raises(ep.InvalidArgumentError) as ei:
        b.dispatch(x, idx, w)
    assert needle in str(ei.value), str(ei.value)
    assert ei.value.code == "InvalidArgument" and str(ei.value).startswith("[InvalidArgument] ")
    # nothing was published: the buffer still works
    d = b.dispatch(*good())
    b.combine(d.recv_x, d.handle)


def test_bad_input_fails_immediately_even_when_peers_never_call():
    """R=2: rank 0's bad input raises at once although rank 1 never dispatches (no wait, no timeout)."""
    def body(r, g):
        b = ep.Buffer(g, num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=C, timeout=30.0, backend="cpu")
        if r == 1:
            return None
        x, idx, w = good()
        with pytest.raises(ep.InvalidArgumentError, match="must be bf16"):
            b.dispatch(x.astype(np.float32), idx, w)
        return "raised"

    import time

    t0 = time.monotonic()
    assert run_ranks(2, body)[0] == "raised"
    assert time.monotonic() - t0 < 10.0


def test_fp8_scale_errors():
    b = single(payload="fp8")
    x8 = np.zeros((2, H), np.uint8)
    _, idx, w = good()
    with pytest.raises(ep.InvalidArgumentError, match=r"x_scales \[2, 1\] \(f32_g128\) is required"):
        b.dispatch(x8, idx, w)
    with pytest.raises(ep.InvalidArgumentError, match="x_scales is int32.*needs fp32"):
        b.dispatch(x8, idx, w, scales=np.zeros((2, 1), np.int32))
    with pytest.raises(ep.InvalidArgumentError, match=r"x_scales is fp32\[2, 2\] cpu but must be \[2, 1\]"):
        b.dispatch(x8, idx, w, scales=np.zeros((2, 2), np.float32))
    with pytest.raises(ep.InvalidArgumentError, match="scales go with pre-quantized fp8 x only"):
        b.dispatch(np.zeros((2, H), np.uint16), idx, w, scales=np.zeros((2, 1), np.float32))
    b16 = single()
    with pytest.raises(ep.InvalidArgumentError, match="scales_mn_major needs an fp8 payload"):
        b16.dispatch(*good(), scales_mn_major=True)


def test_capacity_exceeded():
    b = single()
    x, idx, w = good(C + 1)
    with pytest.raises(ep.CapacityExceededError) as ei:
        b.dispatch(x, idx, w)
    assert isinstance(ei.value, ValueError) and ei.value.code == "CapacityExceeded"
    assert "has 5 tokens but the buffer was built with max_tokens_per_rank=4" in str(ei.value)
    assert "raise max_tokens_per_rank to at least 5" in str(ei.value)


@pytest.mark.parametrize("bad,needle", [(E, "4"), (-2, "-2")])
def test_invalid_expert_ids_fail_every_rank_and_publish_nothing(bad, needle):
    def body(r, g):
        b = ep.Buffer(g, num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=C, timeout=10.0, backend="cpu")
        x, idx, w = good()
        if r == 1:
            idx = idx.copy()
            idx[1, 1] = bad
        with pytest.raises(ep.InvalidArgumentError) as ei:
            b.dispatch(x, idx, w)
        msg = str(ei.value)
        d = b.dispatch(*good())  # the buffer is still usable
        b.combine(d.recv_x, d.handle)
        return msg

    msgs = run_ranks(2, body)
    for m in msgs:  # both ranks name rank 1's first bad route
        assert "rank 1" in m and "token 1" in m and needle in m, m


def test_duplicate_expert_in_row_is_invalid():
    b = single()
    x, idx, w = good()
    idx[0] = [1, 1]
    with pytest.raises(ep.InvalidArgumentError, match="token 0"):
        b.dispatch(x, idx, w)


def test_graph_mode_invalid_ids_are_sticky_until_check():
    b = single()
    x, idx, w = good()
    idx[1, 0] = 99
    d = b.dispatch(x, idx, w, host_sync=False)  # graph mode: bad route dropped, fault recorded
    assert d.num_rows == -1 and int(d.offsets[-1]) == 3  # 2 + 1 valid routes
    b.combine(d.recv_x, d.handle)
    with pytest.raises(ep.InvalidArgumentError, match="sticky fault.*99"):
        b.check()
    b.check()  # reported once, then cleared


def test_handle_misuse():
    b = single()
    other = single()
    d = b.dispatch(*good())
    with pytest.raises(ep.InvalidArgumentError, match="previous dispatch was never combined"):
        b.dispatch(*good())
    od = other.dispatch(*good())
    with pytest.raises(ep.InvalidArgumentError, match="the handle belongs to another buffer"):
        other.combine(od.recv_x, d.handle)
    # One handle rule (issue 10, item 11): a failed combine consumes its handle, whichever layer or
    # buffer rejected it; b may dispatch again.
    assert not d.handle.valid
    with pytest.raises(ep.InvalidArgumentError, match="handle is empty"):
        b.combine(d.recv_x, None)
    with pytest.raises(ep.InvalidArgumentError, match="already consumed"):
        b.combine(d.recv_x, d.handle)
    other.combine(od.recv_x, od.handle)
    # weighted combine without weights; the failed combine still consumes the handle
    d2 = b.dispatch(good()[0], good()[1])
    with pytest.raises(ep.InvalidArgumentError, match="weighted=true but the dispatch had no topk_weights"):
        b.combine(d2.recv_x, d2.handle)
    assert not d2.handle.valid
    d3 = b.dispatch(*good())
    with pytest.raises(ep.InvalidArgumentError, match="combine: y is bf16\\[3, 128\\] cpu but must have the shape"):
        b.combine(np.zeros((3, H), np.uint16), d3.handle)
    d4 = b.dispatch(*good())
    with pytest.raises(ep.InvalidArgumentError, match="combine: y is fp32"):
        b.combine(d4.recv_x.astype(np.float32), d4.handle)
    d5 = b.dispatch(*good())
    with pytest.raises(ep.InvalidArgumentError, match="combine: bias is bf16\\[1, 128\\] cpu but must be \\[2, 128\\]"):
        b.combine(d5.recv_x, d5.handle, bias=np.zeros((1, H), np.uint16))


def test_timeout_when_a_rank_never_dispatches():
    def body(r, g):
        b = ep.Buffer(g, num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=C, timeout=0.3, backend="cpu")
        if r == 1:
            return "idle"
        with pytest.raises(ep.TimeoutError) as ei:
            b.dispatch(*good())
        e = ei.value
        assert isinstance(e, builtins.TimeoutError) and e.code == "Timeout"
        with pytest.raises(ep.TimeoutError, match="unusable"):
            b.check()
        with pytest.raises(ep.TimeoutError, match="unusable"):
            b.dispatch(*good())
        return str(e)

    msg, idle = run_ranks(2, body)
    assert idle == "idle"
    assert "dispatch: rank 0 waited 300 ms for rank(s) 1" in msg, msg


def test_group_collective_timeout():
    g = ep.ThreadGroup(2, timeout=0.2)
    with pytest.raises(ep.TimeoutError, match="rank\\(s\\) 1 never arrived"):
        g[0].barrier()


@pytest.mark.parametrize("kw,needle", [
    (dict(num_experts=5), "num_experts=5 must be a multiple of the number of ranks (2)"),
    (dict(num_topk=0), "num_topk=0 must be in [1, 32]"),
    (dict(hidden=100), "hidden=100 must be a multiple of 8"),
    (dict(payload="fp4"), "unknown payload 'fp4'; choose one of: bf16, fp8"),
    (dict(payload="fp8", hidden=64), "must be a multiple of the scale group (128)"),
    (dict(max_tokens_per_rank=0), "max_tokens_per_rank=0 must be at least 1"),
    (dict(timeout=0), "must be positive"),
    (dict(backend="tpu"), "unknown backend 'tpu'"),
])
def test_config_errors(kw, needle):
    def body(r, g):
        args = dict(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=C, timeout=5.0, backend="cpu")
        args.update(kw)
        with pytest.raises(ep.InvalidArgumentError) as ei:
            ep.Buffer(g, **args)
        return str(ei.value)

    for m in run_ranks(2, body):
        assert needle in m, m


def test_unsupported_backend():
    if ep.backend_available("cuda"):
        pytest.skip("CUDA is usable here")
    with pytest.raises(ep.UnsupportedError, match="backend"):
        single(backend="cuda")


def test_not_a_group_and_destroyed_buffer():
    with pytest.raises(ep.InvalidArgumentError, match="group must be an elasticep.Group"):
        ep.Buffer(object(), num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=C)
    b = single()
    b.destroy()
    with pytest.raises(ep.InvalidArgumentError, match="destroyed"):
        b.dispatch(*good())


def test_caller_output_errors():
    b = single()
    x, idx, w = good()
    rows = b.max_contiguous_rows(1)
    with pytest.raises(ep.InvalidArgumentError, match="caller-provided output recv_x is bf16\\[3, 128\\]"):
        b.dispatch(x, idx, w, out=dict(recv_x=np.zeros((3, H), np.uint16)))
    with pytest.raises(ep.InvalidArgumentError, match="unknown output name"):
        b.dispatch(x, idx, w, out=dict(recv_y=np.zeros((rows, H), np.uint16)))
    with pytest.raises(ep.InvalidArgumentError, match="caller-provided output m_indices"):
        b.dispatch(x, idx, w, out=dict(m_indices=np.zeros(rows, np.int64)))
    d = b.dispatch(x, idx, w)
    with pytest.raises(ep.InvalidArgumentError, match="combine: out is bf16\\[3, 128\\]"):
        b.combine(d.recv_x, d.handle, out=np.zeros((3, H), np.uint16))


def test_errors_from_one_rank_of_two_with_raw_runner():
    """Both ranks' exceptions are the library's own classes (not RuntimeError) across threads."""
    def body(r, g):
        b = ep.Buffer(g, num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=C, timeout=10.0, backend="cpu")
        x, idx, w = good()
        idx[0, 0] = -7
        b.dispatch(x, idx, w)

    _, errs = run_ranks_raw(2, body)
    assert all(isinstance(e, ep.InvalidArgumentError) for e in errs), errs
