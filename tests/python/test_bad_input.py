"""The bad-input suite (issue 10) through the Python API: each probe a hostile or careless caller
tried, as a test. Every case ends in an elasticep error naming the parameter (or a documented
behaviour); nothing crashes, hangs, or writes memory it was not given. Cases that used to crash
the interpreter run in a subprocess, so a crash fails that test instead of killing pytest.
(Item 6, forged peer data, needs a C++ test hook: tests/unit/test_bad_input_peer.cpp. Item 15 is
the CLI's.)"""

import mmap
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import numpy as np
import pytest

from conftest import ep, run_ranks, run_ranks_raw

H, K, E, C = 128, 2, 4, 4


def run_isolated(code, timeout=120, env=None):
    """Runs `code` in a fresh interpreter (with elasticep importable); it must print OK and exit 0."""
    prelude = "import numpy as np, elasticep as ep\n"
    p = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=timeout, env=dict(os.environ, **(env or {})))
    assert p.returncode == 0 and "OK" in p.stdout, (
        "subprocess exited with %d (negative: killed by signal %d)\nstdout:\n%s\nstderr:\n%s"
        % (p.returncode, -p.returncode if p.returncode < 0 else 0, p.stdout, p.stderr[-4000:]))
    return p.stdout


def single(**kw):
    g = ep.ThreadGroup(1, timeout=5.0)[0]
    args = dict(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=C, timeout=5.0, backend="cpu")
    args.update(kw)
    return ep.Buffer(g, **args)


def good(t=2):
    x = (np.arange(t * H, dtype=np.uint16).reshape(t, H) % 100) + 0x3F00
    idx = np.tile(np.array([[0, 1]], np.int64), (t, 1))
    w = np.ones((t, K), np.float32)
    return x.astype(np.uint16), idx, w


# ---- 1. ThreadGroup after a timeout ------------------------------------------------------------------

def test_item01_thread_group_after_a_timeout_fails_cleanly():
    run_isolated("""
        g = ep.ThreadGroup(2, timeout=0.5)
        for attempt in range(3):
            try:
                g[0].barrier()
            except ep.TimeoutError as e:
                msg = str(e)
            else:
                raise AssertionError("no timeout")
            assert ("never arrived" if attempt == 0 else "unusable") in msg, msg
        try:
            g[1].all_gather(b"ab")
        except ep.TimeoutError as e:
            assert "create a new ThreadGroup" in str(e), e
        print("OK")
    """)


# ---- 2. hidden's upper bound ----------------------------------------------------------------------------

@pytest.mark.parametrize("hidden", [2**31 - 8, 2**30, 65536 + 8])
def test_item02_hidden_has_an_upper_bound(hidden):
    run_isolated("""
        try:
            b = ep.Buffer(ep.ThreadGroup(1)[0], num_experts=4, num_topk=2, hidden=%d, max_tokens_per_rank=4,
                          backend="cpu")
            b.dispatch(np.zeros((1, %d), np.uint16), np.array([[0, 1]]))  # the old crash
        except ep.InvalidArgumentError as e:
            assert "hidden=%d" in str(e) and "65536" in str(e), e
            print("OK")
    """ % (hidden, hidden, hidden))


# ---- 3. read-only outputs are refused, not written ----------------------------------------------------

def test_item03_read_only_outputs_are_refused():
    run_isolated("""
        import mmap, tempfile
        b = ep.Buffer(ep.ThreadGroup(1)[0], num_experts=4, num_topk=2, hidden=128, max_tokens_per_rank=4,
                      backend="cpu")
        x = np.full((2, 128), 0x3F80, np.uint16)
        idx = np.array([[0, 1], [2, 3]])
        w = np.ones((2, 2), np.float32)
        rows = b.max_contiguous_rows(1)
        nbytes = rows * 128 * 2
        flagged = np.zeros((rows, 128), np.uint16)
        flagged.setflags(write=False)
        over_bytes = np.frombuffer(bytes(nbytes), np.uint16).reshape(rows, 128)
        f = tempfile.TemporaryFile()
        f.write(bytes(nbytes)); f.flush()
        ro_map = np.frombuffer(mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_READ), np.uint16).reshape(rows, 128)
        for name, arr in [("setflags", flagged), ("bytes", over_bytes), ("PROT_READ mmap", ro_map)]:
            for slot in ("recv_x",):
                try:
                    b.dispatch(x, idx, w, out={slot: arr})
                except ep.InvalidArgumentError as e:
                    assert "caller-provided output recv_x is read-only" in str(e), e
                else:
                    raise AssertionError(name + ": a read-only recv_x was accepted")
                assert not arr.any(), name + ": written"
            d = b.dispatch(x, idx, w)
            out = arr[:2]
            try:
                b.combine(d.recv_x, d.handle, out=out)
            except ep.InvalidArgumentError as e:
                assert "combine: out is read-only" in str(e), e
            else:
                raise AssertionError(name + ": a read-only combine out was accepted")
            assert not arr.any(), name + ": written"
            assert not d.handle.valid
        print("OK")
    """)


# ---- 4. Group.rank() is range checked -------------------------------------------------------------------

def test_item04_group_rank_is_range_checked():
    run_isolated("""
        import threading
        class Lying(ep.Group):
            def __init__(self, inner, rank):
                super().__init__()
                self.inner, self.fake = inner, rank
            def rank(self): return self.fake
            def size(self): return self.inner.size()
            def all_gather(self, data): return self.inner.all_gather(data)
            def barrier(self): self.inner.barrier()
            def identity(self): return self.inner.identity()
        for lie in (-1, 1000, 2, 0):
            inner = ep.ThreadGroup(2, timeout=10.0)
            groups = [inner[0], Lying(inner[1], lie)]
            errs = [None, None]
            def body(r):
                try:
                    b = ep.Buffer(groups[r], num_experts=4, num_topk=2, hidden=128, max_tokens_per_rank=4,
                                  backend="cpu")
                    b.dispatch(np.zeros((1, 128), np.uint16), np.array([[0, 2]]))  # the old crash
                except Exception as e:
                    errs[r] = e
            ts = [threading.Thread(target=body, args=(r,)) for r in range(2)]
            [t.start() for t in ts]; [t.join(30) for t in ts]
            assert all(isinstance(e, ep.InvalidArgumentError) for e in errs), (lie, errs)
            want = "at position 1" if lie == 0 else "rank() is %d" % lie
            assert want in str(errs[1]) and ("rank()" in str(errs[0])), (lie, errs)
        print("OK")
    """)


# ---- 5. views of buffer-owned outputs never dangle ------------------------------------------------------

def test_item05_views_never_dangle():
    # A fixed malloc mmap threshold: a freed block of 1 MB is unmapped at once, so a view that
    # outlived its storage faults when read (glibc otherwise may keep it mapped and hide the bug).
    run_isolated("""
        b = ep.Buffer(ep.ThreadGroup(1)[0], num_experts=4, num_topk=2, hidden=4096, max_tokens_per_rank=64,
                      backend="cpu")
        rng = np.random.default_rng(1)
        x = rng.integers(0, 0x7F00, size=(64, 4096)).astype(np.uint16)
        idx = np.stack([rng.permutation(4)[:2] for _ in range(64)])
        w = np.ones((64, 2), np.float32)
        addr = lambda a: a.__array_interface__["data"][0]
        d = b.dispatch(x, idx, w)
        kept, kept_counts = d.recv_x, d.counts
        b.combine(d.recv_x, d.handle)
        for _ in range(2):
            m = b.dispatch(x, idx, w, layout="masked")  # needs more memory than the contiguous layout had
            b.combine(m.recv_x, m.handle)
        assert int(kept.astype(np.uint64).sum()) > 0  # readable
        d2 = b.dispatch(x, idx, w)
        assert addr(d2.recv_x) == addr(kept), "a layout's storage stays put while its alignment does"
        b.combine(d2.recv_x, d2.handle)
        a = b.dispatch(x, idx, w, expert_alignment=128)  # more rows: new storage, the old stays mapped
        b.combine(a.recv_x, a.handle)
        assert int(kept.astype(np.uint64).sum()) > 0 and int(kept_counts.sum()) == 128
        print("OK")
    """, env={"MALLOC_MMAP_THRESHOLD_": "131072"})


# ---- 7. timeouts have a range ---------------------------------------------------------------------------

@pytest.mark.parametrize("timeout,needle", [
    (1e10, "above the limit of 604800 s (7 days)"),
    (float("inf"), "above the limit of 604800 s (7 days)"),
    (float("nan"), "must be positive"),
    (-1.0, "must be positive"),
    ("soon", "must be a number of seconds"),
])
def test_item07_timeouts_have_a_range(timeout, needle):
    with pytest.raises(ep.InvalidArgumentError) as ei:
        single(timeout=timeout)
    assert needle in str(ei.value) and "timeout=" in str(ei.value), ei.value
    assert "-9223372036854775808" not in str(ei.value)
    with pytest.raises(ep.InvalidArgumentError, match="ThreadGroup: timeout="):
        ep.ThreadGroup(2, timeout=timeout)


def test_item07_the_largest_timeout_is_a_real_bound():
    b = single(timeout=604800.0)
    d = b.dispatch(*good())
    b.combine(d.recv_x, d.handle)


# ---- 8. two threads on one buffer -----------------------------------------------------------------------

def test_item08_second_thread_on_one_buffer_is_refused():
    groups = ep.ThreadGroup(2, timeout=20.0)
    bufs = [None, None]

    def build(r, g):
        bufs[r] = ep.Buffer(groups[r], num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=C, timeout=10.0,
                            backend="cpu")

    ts = [threading.Thread(target=build, args=(r, groups[r])) for r in range(2)]
    [t.start() for t in ts]
    [t.join(30) for t in ts]
    results, errors = [None, None], [None, None]

    def rank0(i):
        try:
            results[i] = bufs[0].dispatch(*good())
        except Exception as e:  # noqa: BLE001
            errors[i] = e

    th = [threading.Thread(target=rank0, args=(i,)) for i in range(2)]
    [t.start() for t in th]
    t0 = time.time()
    while not any(errors) and time.time() - t0 < 10:
        time.sleep(0.005)
    d1 = bufs[1].dispatch(*good())  # completes the round of the thread that got in
    [t.join(30) for t in th]
    refused = [e for e in errors if e is not None]
    assert len(refused) == 1, errors
    assert isinstance(refused[0], ep.InvalidArgumentError)
    assert "is inside Buffer::dispatch" in str(refused[0]) and "one call at a time" in str(refused[0])
    d0 = next(r for r in results if r is not None)
    assert int(d0.counts.sum()) == 8 and int(d1.counts.sum()) == 0  # both ranks route to experts 0 and 1 (rank 0)

    def combine(r):
        d = d0 if r == 0 else d1
        bufs[r].combine(d.recv_x, d.handle)

    ts = [threading.Thread(target=combine, args=(r,)) for r in range(2)]
    [t.start() for t in ts]
    [t.join(30) for t in ts]


# ---- 9. a rank that rejects its config is heard at once -------------------------------------------------

@pytest.mark.parametrize("bad,needle", [
    (dict(hidden=100), "hidden=100 must be a multiple of 8"),            # rejected by C++ validation
    (dict(num_experts=8.7), "num_experts=8.7 (float) must be an integer"),  # rejected while converting
    (dict(payload="fp9"), "unknown payload 'fp9'"),
    (dict(timeout=float("inf")), "timeout=inf"),
])
def test_item09_config_rejected_on_one_rank_fails_every_rank_promptly(bad, needle):
    def body(r, g):
        args = dict(num_experts=6, num_topk=K, hidden=H, max_tokens_per_rank=C, timeout=5.0, backend="cpu")
        if r == 1:
            args.update(bad)
        ep.Buffer(g, **args)

    t0 = time.time()
    _, errs = run_ranks_raw(3, body, group_timeout=60.0)
    assert time.time() - t0 < 10.0, "a peer waited for the rank that gave up"
    assert all(isinstance(e, ep.InvalidArgumentError) for e in errs), errs
    assert needle in str(errs[1]), errs[1]
    for r in (0, 2):
        assert "rank 1 rejected its config" in str(errs[r]) and needle in str(errs[r]), errs[r]


# ---- 10. two groups with one identity -------------------------------------------------------------------

def test_item10_two_groups_with_one_identity_are_refused():
    class Named(ep.Group):
        def __init__(self):
            super().__init__()
            self.inner = ep.ThreadGroup(1)[0]

        def rank(self):
            return 0

        def size(self):
            return 1

        def all_gather(self, data):
            return self.inner.all_gather(data)

        def barrier(self):
            pass

        def identity(self):
            return "one-name"

    ep.reset()
    a, b = Named(), Named()
    args = dict(num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=C, backend="cpu")
    ba = ep.get_buffer(a, **args)
    assert ep.get_buffer(a, **args) is ba
    with pytest.raises(ep.InvalidArgumentError, match="another Group object with the same identity"):
        ep.get_buffer(b, **args)
    ep.reset()
    assert ep.get_buffer(b, **args).group is b
    ep.reset()


# ---- 11. one handle rule ----------------------------------------------------------------------------------

def test_item11_a_combine_rejected_in_python_consumes_the_handle():
    b = single()
    other = single()
    rejections = [
        ("y complex (rejected in Python)", lambda d: b.combine(np.zeros(d.recv_x.shape, np.complex64), d.handle)),
        ("y not an array", lambda d: b.combine([[1, 2]], d.handle)),
        ("y float16 (rejected in C++ bindings)", lambda d: b.combine(d.recv_x.view(np.float16), d.handle)),
        ("read-only out", lambda d: b.combine(d.recv_x, d.handle, out=np.frombuffer(bytes(2 * H * 2), np.uint16)
                                              .reshape(2, H))),
        ("y fp32 (rejected in C++)", lambda d: b.combine(d.recv_x.astype(np.float32), d.handle)),
        ("another buffer", lambda d: other.combine(d.recv_x, d.handle)),
    ]
    for what, fail in rejections:
        d = b.dispatch(*good())
        with pytest.raises(ep.InvalidArgumentError):
            fail(d)
        assert not d.handle.valid, what
        with pytest.raises(ep.InvalidArgumentError, match="already consumed"):
            b.combine(d.recv_x, d.handle)
    d = b.dispatch(*good())  # the buffer was never blocked
    b.combine(d.recv_x, d.handle)
    b.destroy()
    d = other.dispatch(*good())
    other.destroy()
    with pytest.raises(ep.InvalidArgumentError, match="destroyed"):
        other.combine(d.recv_x, d.handle)
    assert not d.handle.valid


# ---- 12. out-of-range and non-integer Python numbers ----------------------------------------------------

@pytest.mark.parametrize("kw,needle", [
    (dict(max_tokens_per_rank=2**31), "max_tokens_per_rank=2147483648 is out of range"),
    (dict(hidden=2**40), "hidden=1099511627776 is out of range: [1, 65536]"),
    (dict(device=2**40), "device=1099511627776 is out of range"),
    (dict(num_experts=8.7), "num_experts=8.7 (float) must be an integer"),
    (dict(num_topk="2"), "num_topk='2' (str) must be an integer"),
    (dict(num_sms=2**70), "num_sms=1180591620717411303424 is out of range: [0, 1024]"),
])
def test_item12_out_of_range_python_numbers_name_the_parameter(kw, needle):
    with pytest.raises(ep.InvalidArgumentError) as ei:
        single(**kw)
    assert needle in str(ei.value), ei.value
    assert "incompatible function arguments" not in str(ei.value)


def test_item12_other_integer_arguments():
    with pytest.raises(ep.InvalidArgumentError, match=r"expert_alignment=2147483648 is out of range: \[1, 65536\]"):
        single().dispatch(*good(), expert_alignment=2**31)
    with pytest.raises(ep.InvalidArgumentError, match=r"expert_alignment=2.5 \(float\) must be an integer"):
        single().max_contiguous_rows(2.5)
    with pytest.raises(ep.InvalidArgumentError, match=r"ThreadGroup: num_ranks=2147483648 is out of range"):
        ep.ThreadGroup(2**31)
    with pytest.raises(ep.InvalidArgumentError, match=r"scale_columns: hidden=-1000 must be in \[1, 65536\]"):
        ep.scale_columns("f32_g128", -1000)
    with pytest.raises(ep.InvalidArgumentError, match=r"hidden=8.7 \(float\) must be an integer"):
        ep.scale_columns("f32_g128", 8.7)
    assert ep.scale_columns("ue8m0_g128", np.int64(7168)) == 14  # numpy integers are integers


# ---- 13. out of memory at create ------------------------------------------------------------------------

def test_item13_out_of_memory_at_create_is_capacity_exceeded_on_every_rank():
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGESIZE")
    cap = min(int(2 * host / (16 * 65536)) + 1, 2**28)  # arena ~ 16 * C * hidden bytes for two ranks

    def body(r, g):
        with pytest.raises(ep.CapacityExceededError) as ei:
            ep.Buffer(g, num_experts=2, num_topk=1, hidden=65536, max_tokens_per_rank=cap, backend="cpu")
        return str(ei.value)

    msgs = run_ranks(2, body)
    assert all("lower max_tokens_per_rank" in m for m in msgs), msgs
    assert "rank 0" in msgs[1], msgs


# ---- 14. clear messages from Python groups and config mismatches ----------------------------------------

class ReturnsA(ep.Group):
    """A one-rank group whose all_gather returns its data as some other type."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def rank(self):
        return 0

    def size(self):
        return 1

    def all_gather(self, data):
        return {"bytearray": bytearray, "memoryview": memoryview, "list of bytearray": lambda d: [bytearray(d)],
                "list of str": lambda d: [d.hex()], "int": lambda d: 7, "str": lambda d: d.hex()}[self.kind](data)

    def barrier(self):
        pass

    def identity(self):
        return "returns-a-" + self.kind


@pytest.mark.parametrize("kind", ["bytearray", "memoryview", "list of bytearray"])
def test_item14_python_groups_may_return_any_bytes_like(kind):
    b = ep.Buffer(ReturnsA(kind), num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=C, backend="cpu")
    d = b.dispatch(*good())
    b.combine(d.recv_x, d.handle)


@pytest.mark.parametrize("kind,needle", [
    ("list of str", "returned a list whose item 0 is str; each item must be bytes"),
    ("int", "returned int; it must return bytes"),
    ("str", "returned str; it must return bytes"),
])
def test_item14_python_group_results_of_the_wrong_type_are_named(kind, needle):
    with pytest.raises(ep.InvalidArgumentError) as ei:
        ep.Buffer(ReturnsA(kind), num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=C, backend="cpu")
    assert needle in str(ei.value) and "bad_cast" not in str(ei.value), ei.value


def test_item14_python_group_methods_of_the_wrong_type_are_named():
    class BadRank(ReturnsA):
        def rank(self):
            return "0"

    with pytest.raises(ep.InvalidArgumentError, match=r"Group.rank\(\) \(Python\) returned '0' \(str\)"):
        ep.Buffer(BadRank("bytearray"), num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=C, backend="cpu")


def test_item14_config_mismatch_names_the_field():
    def body(r, g):
        with pytest.raises(ep.InvalidArgumentError) as ei:
            ep.Buffer(g, num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=C, backend="cpu",
                      scale_format="f32_g128" if r == 0 else "ue8m0_g128")
        return str(ei.value)

    for m in run_ranks(2, body):
        assert "scale_format" in m and "ue8m0_g128 on rank 1" in m and "f32_g128 on rank 0" in m, m


# ---- front-end checks the CUDA kernels rely on ------------------------------------------------------------

def test_misaligned_tensors_are_refused_naming_the_tensor():
    b = single()
    x, idx, w = good()
    raw = np.zeros(idx.size * 8 + 8, np.uint8)
    odd_idx = raw[4:4 + idx.size * 8].view(np.int64).reshape(idx.shape)  # 4 bytes past an 8-byte boundary
    odd_idx[...] = idx
    with pytest.raises(ep.InvalidArgumentError, match="dispatch: topk_idx .* is not aligned to its 8-byte elements"):
        b.dispatch(x, odd_idx, w)
    raw = np.zeros(w.size * 4 + 4, np.uint8)
    odd_w = raw[1:1 + w.size * 4].view(np.float32).reshape(w.shape)
    with pytest.raises(ep.InvalidArgumentError, match="dispatch: topk_weights .* not aligned"):
        b.dispatch(x, idx, odd_w)
    d = b.dispatch(x, idx, w)  # nothing was communicated by the refused calls
    b.combine(d.recv_x, d.handle)


def test_the_bound_argument_classes_list_their_fields():
    """The Python layer fills the C++ structs by these names: they are the options of the signatures."""
    import inspect

    sig = inspect.signature(ep.Buffer.__init__).parameters
    assert set(ep._C.BufferConfig.fields) == set(sig) - {"self", "group", "backend"}
    assert set(inspect.signature(ep.get_buffer).parameters) == set(sig) - {"self"}
    dsig = inspect.signature(ep.Buffer.dispatch).parameters
    assert set(ep._C.DispatchArgs.options) - {"stream"} <= set(dsig)
    assert set(ep._C.DispatchOutputs.fields) == {"recv_x", "recv_scales", "recv_weights", "recv_src", "m_indices"}
    c = ep._C.BufferConfig()
    c.num_experts, c.payload, c.timeout = 8, "fp8", 2.5
    assert (c.num_experts, c.payload, c.timeout) == (8, "fp8", 2.5)
    with pytest.raises(ep.InvalidArgumentError, match="unknown payload 'fp9'"):
        c.payload = "fp9"
