"""torch interop on the CPU backend (skipped without torch): torch in -> torch out, bf16/fp8 dtypes,
and the torch.distributed group adapter (gloo, processes on this machine)."""

import os
import socket

import numpy as np
import pytest

import oracle as O
from conftest import ep, run_ranks

torch = pytest.importorskip("torch")

H, K, E, C = 128, 2, 4, 4


def bits_of(t):
    """Raw bits of a torch tensor as numpy (bf16 -> uint16, fp8 -> uint8)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy()
    return t.numpy()


def test_hand_case_with_torch_cpu_tensors():
    def body(r, g):
        b = ep.Buffer(g, num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=C, timeout=10.0, backend="cpu")
        if r == 0:
            x = torch.tensor([[1.0] * H, [2.0] * H], dtype=torch.bfloat16)
            idx = torch.tensor([[1, 2], [3, -1]])
            w = torch.tensor([[0.5, 0.25], [1.0, 0.0]], requires_grad=True)
        else:
            x = torch.full((1, H), 3.0, dtype=torch.bfloat16)
            idx = torch.tensor([[0, 1]], dtype=torch.int32)
            w = torch.tensor([[2.0, 1.0]])
        d = b.dispatch(x, idx, w, layout="masked")
        assert isinstance(d.recv_x, torch.Tensor) and d.recv_x.dtype == torch.bfloat16
        assert d.masked_m.dtype == torch.int32 and d.recv_weights.dtype == torch.float32
        out = b.combine(d.recv_x * 2, d.handle)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == (x.shape[0], H)
        return d.masked_m.tolist(), out[:, 0].float().tolist(), bool((out == out[:, :1]).all())

    (m0, o0, f0), (m1, o1, f1) = run_ranks(2, body)
    assert m0 == [1, 2] and m1 == [1, 1]
    assert o0 == [1.5, 4.0] and o1 == [18.0] and f0 and f1


@pytest.mark.parametrize("payload,fmt,layout", [("bf16", "f32_g128", "contiguous"), ("fp8", "f32_g128", "masked"),
                                                ("fp8", "ue8m0_g32", "contiguous")])
def test_torch_outputs_equal_numpy_outputs(payload, fmt, layout):
    """The same inputs through torch CPU tensors and numpy arrays give the same bytes."""
    Hh = 256
    rng = np.random.default_rng(5)
    xs = [O.f32_to_bf16(rng.standard_normal((3, Hh)).astype(np.float32)) for _ in range(2)]
    idxs = [np.argsort(rng.random((3, E)), axis=1)[:, :K].astype(np.int64) for _ in range(2)]
    ws = [rng.random((3, K)).astype(np.float32) for _ in range(2)]

    def run(use_torch):
        def body(r, g):
            b = ep.Buffer(g, num_experts=E, num_topk=K, hidden=Hh, max_tokens_per_rank=C, payload=payload,
                          scale_format=fmt, timeout=10.0, backend="cpu")
            x, idx, w = xs[r], idxs[r], ws[r]
            if use_torch:
                x = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
                idx, w = torch.from_numpy(idx), torch.from_numpy(w)
            d = b.dispatch(x, idx, w, layout=layout)
            snap = {k: (None if getattr(d, k) is None else bits_of(getattr(d, k)) if use_torch
                        else np.array(getattr(d, k)))
                    for k in ("recv_x", "recv_scales", "recv_weights", "recv_src", "counts")}
            if use_torch:
                assert d.recv_x.dtype == (torch.float8_e4m3fn if payload == "fp8" else torch.bfloat16)
                y = torch.zeros(d.recv_x.shape, dtype=torch.bfloat16)
                y.view(torch.int16)[...] = 0x3F80  # 1.0
            else:
                y = np.full(d.recv_x.shape, 0x3F80, np.uint16)
            out = b.combine(y, d.handle)
            snap["out"] = bits_of(out) if use_torch else np.array(out)
            return snap

        return run_ranks(2, body)

    a, b = run(True), run(False)
    for r in range(2):
        for k in a[r]:
            if a[r][k] is None:
                assert b[r][k] is None
            else:
                np.testing.assert_array_equal(a[r][k].view(np.uint8), b[r][k].view(np.uint8), err_msg=k)


def test_torch_fp8_prequantized_in_and_out():
    g = ep.ThreadGroup(1)[0]
    b = ep.Buffer(g, num_experts=2, num_topk=1, hidden=128, max_tokens_per_rank=2, payload="fp8", backend="cpu")
    xb = O.f32_to_bf16(np.random.default_rng(1).standard_normal((2, 128)).astype(np.float32))
    q, s = O.quantize(xb, "f32_g128")
    x8 = torch.from_numpy(q).view(torch.float8_e4m3fn)
    d = b.dispatch(x8, torch.tensor([[1], [0]]), scales=torch.from_numpy(s))
    assert d.recv_x.dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(bits_of(d.recv_x), q[[1, 0]])
    b.combine(torch.zeros(d.recv_x.shape, dtype=torch.bfloat16), d.handle, weighted=False)


def test_torch_bad_dtype_message():
    g = ep.ThreadGroup(1)[0]
    b = ep.Buffer(g, num_experts=2, num_topk=1, hidden=128, max_tokens_per_rank=2, backend="cpu")
    with pytest.raises(ep.InvalidArgumentError, match=r"dispatch: x is float16\[2, 128\] cpu, which ElasticEP"):
        b.dispatch(torch.zeros(2, 128, dtype=torch.float16), torch.zeros(2, 1, dtype=torch.int64))
    with pytest.raises(ep.InvalidArgumentError, match=r"dispatch: x is fp32\[2, 128\] cpu but must be bf16"):
        b.dispatch(torch.zeros(2, 128), torch.zeros(2, 1, dtype=torch.int64))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dist_worker(rank, world, port, q):
    import torch.distributed as dist

    import elasticep as ep2

    try:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=world)
        g = ep2.TorchGroup()
        got = b"".join(g.all_gather(bytes([rank + 1])))
        g.barrier()
        res = {"rank": g.rank(), "size": g.size(), "gather": got, "id": g.identity()}
        # the hand case across two processes: the CPU backend over the Python (torch) group
        b = ep2.Buffer(dist.group.WORLD, num_experts=4, num_topk=2, hidden=128, max_tokens_per_rank=4, timeout=30.0,
                       backend="cpu")
        if rank == 0:
            x = torch.tensor([[1.0] * 128, [2.0] * 128], dtype=torch.bfloat16)
            idx, w = torch.tensor([[1, 2], [3, -1]]), torch.tensor([[0.5, 0.25], [1.0, 0.0]])
        else:
            x = torch.full((1, 128), 3.0, dtype=torch.bfloat16)
            idx, w = torch.tensor([[0, 1]]), torch.tensor([[2.0, 1.0]])
        d = b.dispatch(x, idx, w)
        out = b.combine(d.recv_x, d.handle)
        res["recv"] = d.recv_x[:, 0].float().tolist()
        res["src"] = d.recv_src.tolist()
        res["out"] = out[:, 0].float().tolist()
        dist.destroy_process_group()
        q.put(res)
    except BaseException as e:  # noqa: BLE001
        q.put({"rank": rank, "error": repr(e)})


def test_torch_distributed_group_gloo_two_processes():
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([os.path.dirname(ep.__path__[0]), os.path.dirname(__file__), env_path])
    procs = [ctx.Process(target=_dist_worker, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = sorted((q.get(timeout=120) for _ in procs), key=lambda d: d["rank"])
    for p in procs:
        p.join(60)
    assert all("error" not in d for d in res), res
    assert [d["size"] for d in res] == [2, 2]
    assert all(d["gather"] == bytes([1, 2]) for d in res)
    assert res[0]["id"] == res[1]["id"] and res[0]["id"].startswith("torch-pg-")
    assert res[0]["recv"] == [3.0, 1.0, 3.0] and res[0]["src"] == [4, 0, 4] and res[0]["out"] == [0.75, 2.0], res
    assert res[1]["recv"] == [1.0, 2.0] and res[1]["src"] == [0, 1] and res[1]["out"] == [9.0], res
