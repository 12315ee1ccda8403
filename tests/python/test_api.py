"""The Python surface: groups implemented in Python, the registry, caller-provided outputs, output
lifetimes, and the module helpers."""

import threading

import numpy as np
import pytest

import oracle as O
from conftest import ep, run_ranks

H, K, E, C = 128, 2, 4, 4


class PyThreadGroup(ep.Group):
    """A Group written in Python (the trampoline path): ranks are threads meeting at a barrier."""

    class Shared:
        def __init__(self, n):
            self.n = n
            self.slots = [None] * n
            self.barrier = threading.Barrier(n, timeout=20)
            self.calls = 0
            self.lock = threading.Lock()

    def __init__(self, shared, rank):
        super().__init__()
        self.shared, self._rank = shared, rank

    def rank(self):
        return self._rank

    def size(self):
        return self.shared.n

    def all_gather(self, data):
        with self.shared.lock:
            self.shared.calls += 1
        self.shared.slots[self._rank] = bytes(data)
        self.shared.barrier.wait()
        out = list(self.shared.slots)
        self.shared.barrier.wait()
        return out if self._rank % 2 == 0 else b"".join(out)  # both return forms are accepted

    def barrier(self):
        self.shared.barrier.wait()

    def identity(self):
        return "py-thread-group-%d" % id(self.shared)


def hand_inputs(r):
    if r == 0:
        return (np.array([[0x3F80] * H, [0x4000] * H], np.uint16), np.array([[1, 2], [3, -1]], np.int64),
                np.array([[0.5, 0.25], [1.0, 0.0]], np.float32))
    return np.array([[0x4040] * H], np.uint16), np.array([[0, 1]], np.int32), np.array([[2.0, 1.0]], np.float32)


def test_group_implemented_in_python():
    shared = PyThreadGroup.Shared(2)
    groups = [PyThreadGroup(shared, r) for r in range(2)]
    res = [None, None]
    errs = [None, None]

    def body(r):
        try:
            b = ep.Buffer(groups[r], num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=C, timeout=10.0,
                          backend="cpu")
            assert b.rank == r and b.num_ranks == 2 and b.group is groups[r]
            assert b.kernel_path == "reference"
            d = b.dispatch(*hand_inputs(r))
            res[r] = (d.recv_x[:, 0].tolist(), b.combine(d.recv_x, d.handle)[:, 0].tolist())
        except BaseException as e:  # noqa: BLE001
            errs[r] = e

    ts = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert errs == [None, None], errs
    assert res[0] == ([0x4040, 0x3F80, 0x4040], [0x3F40, 0x4000])
    assert res[1] == ([0x3F80, 0x4000], [0x4110])
    assert shared.calls >= 2  # the library really went through the Python all_gather


def test_python_group_bad_all_gather_result_is_an_error():
    class Broken(ep.Group):
        def rank(self):
            return 0

        def size(self):
            return 1

        def all_gather(self, data):
            return b"x"  # wrong length

        def barrier(self):
            pass

        def identity(self):
            return "broken"

    with pytest.raises(ep.InternalError, match="returned 1 bytes"):
        ep.Buffer(Broken(), num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=C, backend="cpu")


def test_thread_group_collectives_from_python():
    def body(r, g):
        got = g.all_gather(bytes([r, 10 + r]))
        g.barrier()
        return g.rank(), g.size(), got, g.identity()

    res = run_ranks(3, body)
    assert [x[0] for x in res] == [0, 1, 2] and all(x[1] == 3 for x in res)
    assert all(x[2] == bytes([0, 10, 1, 11, 2, 12]) for x in res)
    assert len({x[3] for x in res}) == 1


def test_registry_get_buffer_and_reset():
    def body(r, g):
        kw = dict(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=C, timeout=10.0, backend="cpu")
        a = ep.get_buffer(g, **kw)
        a2 = ep.get_buffer(g, **kw)
        kw2 = dict(kw, max_tokens_per_rank=C + 1)
        b = ep.get_buffer(g, **kw2)  # key change: rebuilt collectively
        b2 = ep.get_buffer(g, **kw2)
        g.barrier()
        if r == 0:
            ep.reset()
        g.barrier()
        # reset is process-wide; every rank rebuilds
        c = ep.get_buffer(g, **kw2)
        d = c.dispatch(*hand_inputs(r))
        out = c.combine(d.recv_x, d.handle)[:, 0].tolist()
        return a is a2, b is b2, a is not b, c is not b, out

    for same_a, same_b, differ, rebuilt, _ in run_ranks(2, body):
        assert same_a and same_b and differ and rebuilt


def test_caller_provided_outputs_are_filled_in_place():
    def body(r, g):
        b = ep.Buffer(g, num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=C, timeout=10.0, backend="cpu")
        rows = b.max_contiguous_rows(2)
        mine = dict(recv_x=np.zeros((rows, H), np.uint16), recv_weights=np.zeros(rows, np.float32),
                    recv_src=np.zeros(rows, np.int32), m_indices=np.zeros(rows, np.int32))
        x, idx, w = hand_inputs(r)
        d = b.dispatch(x, idx, w, expert_alignment=2, out=mine)
        m = d.num_rows
        assert np.shares_memory(d.recv_x, mine["recv_x"]) and d.recv_x.shape == (m, H)
        assert np.shares_memory(d.m_indices, mine["m_indices"])
        out_buf = np.zeros(x.shape, np.uint16)
        out = b.combine(d.recv_x, d.handle, out=out_buf)
        assert np.shares_memory(out, out_buf)
        return mine["recv_x"][:m, 0].tolist(), mine["m_indices"][:m].tolist(), out_buf[:, 0].tolist()

    (x0, mi0, o0), (x1, mi1, o1) = run_ranks(2, body)
    assert x0 == [0x4040, 0, 0x3F80, 0x4040] and mi0 == [0, -1, 1, 1]
    assert o0 == [0x3F40, 0x4000] and o1 == [0x4110]


def test_buffer_owned_outputs_outlive_destroy_and_are_reused():
    g = ep.ThreadGroup(1)[0]
    b = ep.Buffer(g, num_experts=2, num_topk=1, hidden=H, max_tokens_per_rank=2, backend="cpu")
    x = np.full((2, H), 0x3F80, np.uint16)
    idx = np.array([[0], [1]], np.int64)
    d = b.dispatch(x, idx)
    first = d.recv_x
    b.combine(d.recv_x, d.handle, weighted=False)
    d2 = b.dispatch(np.full((2, H), 0x4000, np.uint16), idx)
    assert np.shares_memory(first, d2.recv_x)  # the documented lifetime: reused by the next dispatch
    assert (first == 0x4000).all()
    b.combine(d2.recv_x, d2.handle, weighted=False)
    b.destroy()
    del b
    assert (d2.recv_x == 0x4000).all()  # the view keeps the native buffer's memory alive


def test_fp8_numpy_outputs_and_scale_columns():
    mld = pytest.importorskip("ml_dtypes")
    g = ep.ThreadGroup(1)[0]
    b = ep.Buffer(g, num_experts=2, num_topk=2, hidden=256, max_tokens_per_rank=3, payload="fp8", backend="cpu")
    rng = np.random.default_rng(0)
    xb = O.f32_to_bf16(rng.standard_normal((3, 256)).astype(np.float32))
    idx = np.array([[0, 1], [1, 0], [0, -1]], np.int64)
    d = b.dispatch(xb.view(mld.bfloat16), idx, layout="masked")
    assert d.recv_x.dtype == np.dtype(mld.float8_e4m3fn) and d.recv_x.shape == (2, 3, 256)
    assert d.recv_scales.dtype == np.float32 and d.recv_scales.shape == (2, 3, ep.scale_columns("f32_g128", 256))
    q, s = O.quantize(xb, "f32_g128")
    np.testing.assert_array_equal(d.recv_x[0, :3].view(np.uint8), q[[0, 1, 2]])
    np.testing.assert_array_equal(d.recv_scales[1, :2], s[[0, 1]])
    b.combine(np.zeros((2, 3, 256), np.uint16), d.handle, weighted=False)
    # uint8 bits in -> uint8 bits out (no ml_dtypes flavour)
    q8, s8 = O.quantize(xb, "f32_g128")
    d = b.dispatch(q8, idx, scales=s8)
    assert d.recv_x.dtype == np.uint8
    b.combine(np.zeros(d.recv_x.shape, np.uint16), d.handle, weighted=False)


def test_module_helpers():
    info = ep.system_info()
    assert info["version"] == ep.__version__ and "cpu" in info["backends_compiled"]
    assert ep.backend_available("cpu")
    assert ep.scale_columns("ue8m0_g32", 7168) == 56 and ep.scale_columns("f32_g128", 7168) == 56
    assert ep.scale_columns("ue8m0_g128", 7168) == 14
    assert ep.Buffer.__doc__ and ep.Buffer.dispatch.__doc__ and ep.Buffer.combine.__doc__
    assert ep.Group.__doc__ and ep.ThreadGroup.__doc__ and ep.get_buffer.__doc__ and ep.DispatchResult.__doc__
