"""GPU tests (skipped without torch, a GPU, or the CUDA backend): several ranks on one GPU with torch
CUDA tensors compared exactly with the CPU backend; torch.cuda.graph capture of the masked path; one
process per GPU through torch.distributed when 2+ GPUs are present."""

import os
import socket
import threading

import numpy as np
import pytest

import oracle as O
from conftest import ep

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
if not ep.backend_available("cuda"):
    pytest.skip("the CUDA backend is not compiled in or not usable", allow_module_level=True)

torch.cuda.init()  # initialise torch's CUDA state here, not lazily inside rank threads
torch.cuda.current_device()

KEYS = ("recv_x", "recv_scales", "recv_weights", "recv_src", "m_indices", "counts", "offsets", "masked_m")


def bits(t):
    if t is None:
        return None
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16).copy()
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().copy()
    return t.numpy().copy()


def make_inputs(R, E, K, H, C, seed, drop=0.1):
    rng = np.random.default_rng(seed)
    out = []
    for r in range(R):
        T = C if r == 0 else int(rng.integers(0, C + 1))
        x = O.f32_to_bf16((rng.standard_normal((T, H)) * np.exp(rng.normal(0, 1, (T, 1)))).astype(np.float32))
        idx = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int64)
        idx[rng.random((T, K)) < drop] = -1
        w = rng.standard_normal((T, K)).astype(np.float32)
        y_seed = int(rng.integers(1 << 30))
        out.append((x, idx, w, y_seed))
    return out


def run_threads(R, fn):
    groups = ep.ThreadGroup(R, timeout=60)
    res, errs = [None] * R, [None] * R

    def body(r):
        try:
            res[r] = fn(r, groups[r])
        except BaseException as e:  # noqa: BLE001
            errs[r] = e

    ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(R)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
        assert not t.is_alive(), "rank thread hung"
    for r, e in enumerate(errs):
        if e is not None:
            raise AssertionError("rank %d: %s: %s" % (r, type(e).__name__, e)) from e
    return res


def run_backend(backend, inputs, cfg, opts):
    R = len(inputs)

    def body(r, g):
        dev = "cuda" if backend == "cuda" else "cpu"
        stream = torch.cuda.Stream() if dev == "cuda" else None
        with torch.cuda.stream(stream):
            b = ep.Buffer(g, backend=backend, timeout=30.0, **cfg)
            x, idx, w, y_seed = inputs[r]
            xt = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).to(dev)
            d = b.dispatch(xt, torch.from_numpy(idx).to(dev), torch.from_numpy(w).to(dev), **opts)
            snap = {k: bits(getattr(d, k)) for k in KEYS}
            gen = np.random.default_rng(y_seed)
            y = O.f32_to_bf16(gen.standard_normal(tuple(d.recv_x.shape)).astype(np.float32))
            yt = torch.from_numpy(y.view(np.int16)).view(torch.bfloat16).to(dev)
            out = b.combine(yt, d.handle)
            snap["out"] = bits(out)
            if dev == "cuda":
                torch.cuda.current_stream().synchronize()
            return snap

    return run_threads(R, body)


def assert_same(a, b, opts, cfg):
    """Exact equality of every specified byte (padding data only when zero_padding)."""
    for r in range(len(a)):
        for k in a[r]:
            x, y = a[r][k], b[r][k]
            if x is None or y is None:
                assert x is None and y is None, (r, k)
                continue
            assert x.shape == y.shape, (r, k, x.shape, y.shape)
            if k in ("recv_x", "recv_scales", "recv_weights", "recv_src") and opts.get("layout") == "masked":
                counts = a[r]["counts"]
                for l, n in enumerate(counts.tolist()):
                    np.testing.assert_array_equal(x[l, :n], y[l, :n], err_msg="rank %d %s expert %d" % (r, k, l))
            elif k in ("recv_x", "recv_scales") and not opts.get("zero_padding"):
                real = a[r]["m_indices"] >= 0
                np.testing.assert_array_equal(x[real], y[real], err_msg="rank %d %s" % (r, k))
            else:
                np.testing.assert_array_equal(x, y, err_msg="rank %d %s" % (r, k))


SCENARIOS = [
    (3, dict(num_experts=12, num_topk=4, hidden=512, max_tokens_per_rank=32), dict()),
    (4, dict(num_experts=16, num_topk=8, hidden=1024, max_tokens_per_rank=16, payload="fp8"),
     dict(layout="masked")),
    (2, dict(num_experts=8, num_topk=2, hidden=256, max_tokens_per_rank=24, payload="fp8",
             scale_format="ue8m0_g128"), dict(expert_alignment=8, zero_padding=True, scales_mn_major=True)),
    (2, dict(num_experts=4, num_topk=2, hidden=128, max_tokens_per_rank=8), dict(host_sync=False,
                                                                                   expert_alignment=4)),
]


@pytest.mark.parametrize("R,cfg,opts", SCENARIOS)
def test_several_ranks_on_one_gpu_equal_cpu_backend(R, cfg, opts):
    inputs = make_inputs(R, cfg["num_experts"], cfg["num_topk"], cfg["hidden"], cfg["max_tokens_per_rank"], seed=R)
    gpu = run_backend("cuda", inputs, cfg, opts)
    cpu = run_backend("cpu", inputs, cfg, opts)
    assert_same(gpu, cpu, opts, cfg)


def test_cuda_graph_capture_of_masked_path_replays_correctly():
    R, cfg = 2, dict(num_experts=8, num_topk=2, hidden=256, max_tokens_per_rank=8)
    first = make_inputs(R, 8, 2, 256, 8, seed=11, drop=0.0)
    second = make_inputs(R, 8, 2, 256, 8, seed=12, drop=0.2)
    # decode shapes are fixed: pad every rank to C tokens with -1 routes
    def pad(inp):
        out = []
        for x, idx, w, s in inp:
            T = x.shape[0]
            xp = np.zeros((8, 256), np.uint16)
            xp[:T] = x
            ip = np.full((8, 2), -1, np.int64)
            ip[:T] = idx
            wp = np.zeros((8, 2), np.float32)
            wp[:T] = w
            out.append((xp, ip, wp, s))
        return out

    first, second = pad(first), pad(second)
    barrier = threading.Barrier(R)

    def body(r, g):
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            b = ep.Buffer(g, backend="cuda", timeout=30.0, **cfg)
            x = torch.zeros(8, 256, dtype=torch.bfloat16, device="cuda")
            idx = torch.zeros(8, 2, dtype=torch.int64, device="cuda")
            w = torch.zeros(8, 2, dtype=torch.float32, device="cuda")
            y = torch.zeros(4, R * 8, 256, dtype=torch.bfloat16, device="cuda")

            def load(inp):
                xs, ids, ws, _ = inp[r]
                x.copy_(torch.from_numpy(xs.view(np.int16)).view(torch.bfloat16))
                idx.copy_(torch.from_numpy(ids))
                w.copy_(torch.from_numpy(ws))

            def step(host_sync=None):
                # host_sync=None: no host synchronisation while capturing (the Python layer sees it)
                d = b.dispatch(x, idx, w, layout="masked", host_sync=host_sync)
                y.copy_(d.recv_x)
                y.mul_(2)  # the "expert"
                return d, b.combine(y, d.handle)

            load(first)
            step(host_sync=False)  # warm-up outside capture, in the mode that will be captured
            torch.cuda.current_stream().synchronize()
            barrier.wait()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=s, capture_error_mode="thread_local"):
                d, out = step()
            barrier.wait()
            snaps = []
            for inp in (first, second):
                load(inp)
                torch.cuda.current_stream().synchronize()
                barrier.wait()
                graph.replay()
                torch.cuda.current_stream().synchronize()
                snaps.append({k: bits(getattr(d, k)) for k in ("recv_x", "recv_weights", "recv_src", "masked_m")}
                             | {"out": bits(out)})
                barrier.wait()
            return snaps

    got = run_threads(R, body)

    for which, inp in enumerate((first, second)):
        def ref_body(r, g):
            b = ep.Buffer(g, backend="cpu", timeout=30.0, **cfg)
            xs, ids, ws, _ = inp[r]
            d = b.dispatch(xs, ids, ws, layout="masked")
            snap = {k: np.array(getattr(d, k)) for k in ("recv_x", "recv_weights", "recv_src", "masked_m")}
            y = (d.recv_x.astype(np.uint32) + np.where(d.recv_x & 0x7F80, 1 << 7, 0)).astype(np.uint16)
            snap["out"] = np.array(b.combine(y, d.handle))
            return snap

        ref = run_threads(R, ref_body)
        for r in range(R):
            np.testing.assert_array_equal(got[r][which]["masked_m"], ref[r]["masked_m"])
            for l, n in enumerate(ref[r]["masked_m"].tolist()):
                for k in ("recv_x", "recv_weights", "recv_src"):
                    np.testing.assert_array_equal(got[r][which][k][l, :n], ref[r][k][l, :n],
                                                  err_msg="replay %d rank %d %s" % (which, r, k))
            np.testing.assert_array_equal(got[r][which]["out"], ref[r]["out"], err_msg="replay %d rank %d out"
                                          % (which, r))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpu_worker(rank, world, port, q):
    import torch.distributed as dist

    import elasticep as ep2

    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=world)
        cfg = dict(num_experts=4 * world, num_topk=2, hidden=256, max_tokens_per_rank=16)
        inputs = make_inputs(world, cfg["num_experts"], 2, 256, 16, seed=21)
        b = ep2.Buffer(dist.group.WORLD, backend="cuda", timeout=60.0, **cfg)
        x, idx, w, y_seed = inputs[rank]
        d = b.dispatch(torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda(), torch.from_numpy(idx).cuda(),
                       torch.from_numpy(w).cuda())
        snap = {k: bits(getattr(d, k)) for k in KEYS}
        y = O.f32_to_bf16(np.random.default_rng(y_seed).standard_normal(tuple(d.recv_x.shape)).astype(np.float32))
        out = b.combine(torch.from_numpy(y.view(np.int16)).view(torch.bfloat16).cuda(), d.handle)
        snap["out"] = bits(out)
        torch.cuda.synchronize()
        # the reference for all ranks, in this process, on the CPU backend
        ref = run_backend("cpu", inputs, cfg, {})[rank]
        dist.barrier()
        dist.destroy_process_group()
        bad = [k for k in snap if (snap[k] is None) != (ref[k] is None) or
               (snap[k] is not None and not np.array_equal(snap[k], ref[k]))]
        q.put({"rank": rank, "bad": bad})
    except BaseException as e:  # noqa: BLE001
        q.put({"rank": rank, "error": repr(e)})


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ GPUs")
def test_one_process_per_gpu_equals_cpu_backend():
    import torch.multiprocessing as mp

    world = min(torch.cuda.device_count(), 4)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    os.environ["PYTHONPATH"] = os.pathsep.join([os.path.dirname(ep.__path__[0]), os.path.dirname(__file__),
                                                os.environ.get("PYTHONPATH", "")])
    procs = [ctx.Process(target=_gpu_worker, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    assert all("error" not in d for d in res), res
    assert all(d["bad"] == [] for d in res), res
