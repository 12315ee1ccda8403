"""elasticep.serving with torch CUDA tensors (skipped without torch, a GPU or the CUDA backend): the
adapters byte for byte against the same calls on numpy (the CPU adapter), the whole MoE layer through
cuBLASLt against the numpy dense reference, and the decode layer (dispatch -> masked GEMMs ->
combine) captured with torch.cuda.graph and replayed with new inputs."""

import threading

import numpy as np
import pytest

import moe_dense as D
import oracle as O
from conftest import ep, run_ranks

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
if not ep.backend_available("cuda"):
    pytest.skip("the CUDA backend is not compiled in or not usable", allow_module_level=True)

torch.cuda.init()
torch.cuda.current_device()
S = ep.serving

DEEPSEEK_V3 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def bits(t):
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy()
    return t.numpy()


def cuda_bf16(a):
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).cuda()


def run_threads(R, fn):
    """conftest.run_ranks with the waits of a GPU layer."""
    return run_ranks(R, fn, timeout=600.0, group_timeout=120.0)


def test_adapters_on_cuda_equal_the_cpu_adapters():
    rng = np.random.default_rng(21)
    for it in range(12):
        e, s, w, a = int(rng.integers(1, 8)), int(rng.integers(1, 20)), int(rng.integers(1, 5)) * 64, [1, 8, 128][it % 3]
        slab = rng.integers(0, 65536, (e, s, w)).astype(np.uint16)
        slab[..., :] &= 0xbfff  # mostly finite bf16
        mm = rng.integers(0, s + 1, e).astype(np.int32)
        scales = rng.random((e, s, 4)).astype(np.float32)
        wts = rng.uniform(-2, 2, (e * ((s + a - 1) // a * a),)).astype(np.float32)
        cpu = S.masked_to_contiguous(slab, mm, expert_alignment=a, scales=scales, scales_mn_major=True, weights=wts)
        gpu = S.masked_to_contiguous(cuda_bf16(slab), torch.from_numpy(mm).cuda(), expert_alignment=a,
                                     scales=torch.from_numpy(scales).cuda(), scales_mn_major=True,
                                     weights=torch.from_numpy(wts).cuda())
        real = cpu[2] >= 0
        np.testing.assert_array_equal(bits(gpu[0])[real], cpu[0][real])
        np.testing.assert_array_equal(bits(gpu[1]), cpu[1])
        np.testing.assert_array_equal(bits(gpu[2]), cpu[2])
        np.testing.assert_array_equal(bits(gpu[3])[real], cpu[3][real])
        back_c = S.contiguous_to_masked(cpu[0], mm, cpu[1], slab_rows=s, scales=cpu[3])
        back_g = S.contiguous_to_masked(gpu[0], torch.from_numpy(mm).cuda(), gpu[1], slab_rows=s, scales=gpu[3])
        for l in range(e):
            np.testing.assert_array_equal(bits(back_g[0])[l, :mm[l]], back_c[0][l, :mm[l]])
            np.testing.assert_array_equal(bits(back_g[2])[l, :mm[l]], back_c[2][l, :mm[l]])
        y = rng.integers(0, 65536, (e, s, w)).astype(np.uint16)
        yw = rng.uniform(-4, 4, (e, s)).astype(np.float32)
        out_c = S.apply_route_weights(y.copy(), yw, mm)
        out_g = S.apply_route_weights(cuda_bf16(y), torch.from_numpy(yw).cuda(), torch.from_numpy(mm).cuda())
        np.testing.assert_array_equal(bits(out_g), out_c)
        sc = (rng.random((s, 9)) * 2.0 ** rng.integers(-20, 20, (s, 9))).astype(np.float32)
        np.testing.assert_array_equal(bits(S.fp32_scales_to_ue8m0(torch.from_numpy(sc).cuda())),
                                      np.asarray(S.fp32_scales_to_ue8m0(sc)))
        np.testing.assert_array_equal(bits(S.convert_scale_layout(torch.from_numpy(sc).cuda())), S.convert_scale_layout(sc))


def synthetic_layer(kind, first, count, H, I, seed, graph_safe=False):
    w = S.synthetic_expert_weights(kind, count, H, I, first_expert=first, seed=seed, like=torch.device("cuda"))
    return S.ReferenceMoeLayer(w["gate_up"], w["down"], gate_up_scales=w.get("gate_up_scales"),
                               down_scales=w.get("down_scales"), graph_safe=graph_safe)


def layer_inputs(R, T, E, K, H, seed):
    out = []
    for r in range(R):
        rng = np.random.default_rng(seed * 10 + r)
        x = O.f32_to_bf16(rng.uniform(-1, 1, (T, H)).astype(np.float32))
        idx = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int64)
        idx[rng.random((T, K)) < 0.1] = -1
        w = (rng.uniform(0.1, 1.0, (T, K)) * 2.5).astype(np.float32)
        out.append((x, idx, w))
    return out


def check_dense(outs, inputs, kind, E, H, I, seed, note):
    fp8 = kind == "fp8_block128"
    experts = D.weights_f64(S.synthetic_expert_weights(kind, E, H, I, seed=seed))
    shared = D.weights_f64(S.synthetic_expert_weights(kind, 1, H, I, first_expert=1000, seed=seed))
    for r, (x, idx, w) in enumerate(inputs):
        ref, var = D.moe(x, idx, w, experts, fp8, shared, dequant="DEQUANTIZED" in note)
        ratio = D.rms_ratio(outs[r], ref, var)
        print("rank %d: rms err / rms sigma %.3f; %s" % (r, ratio, note))
        assert ratio <= 1.5, "rank %d: rms err / rms sigma %.3f (%s)" % (r, ratio, note)


@pytest.mark.parametrize("kind", ["fp8_block128", "bf16"])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_whole_layer_on_cuda_matches_the_dense_reference(kind, phase):
    R, E, K, H, I, T = 2, 8, 4, 512, 256, 12
    quant = DEEPSEEK_V3 if kind == "fp8_block128" else None
    inputs = layer_inputs(R, T, E, K, H, seed=3)
    notes = []

    def body(r, g):
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            buf = S.serving_buffer(g, E, K, H, T, quant=quant, backend="cuda", cached=False)
            disp = S.MoeDispatcher(buf)
            experts = synthetic_layer(kind, r * (E // R), E // R, H, I, 7)
            shared = synthetic_layer(kind, 1000, 1, H, I, 7)
            notes.append(experts.path_note)
            x, idx, w = inputs[r]
            xt = cuda_bf16(x)
            bias = shared.forward_dense(0, xt)
            d = disp.dispatch(xt, torch.from_numpy(idx).cuda(), torch.from_numpy(w).cuda(), phase=phase)
            out = disp.combine(experts(d), bias=bias)
            torch.cuda.current_stream().synchronize()
            return bits(out).copy()

    outs = run_threads(R, body)
    check_dense(outs, inputs, kind, E, H, I, 7, notes[0])


def test_cuda_graph_capture_of_the_decode_layer_replays_correctly():
    R, E, K, H, I, T = 2, 8, 4, 512, 256, 8
    rounds = [layer_inputs(R, T, E, K, H, seed=s) for s in (11, 12, 13)]
    barrier = threading.Barrier(R)
    notes = []

    def body(r, g):
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            buf = S.serving_buffer(g, E, K, H, T, quant=DEEPSEEK_V3, backend="cuda", cached=False)
            disp = S.MoeDispatcher(buf)
            experts = synthetic_layer("fp8_block128", r * (E // R), E // R, H, I, 9, graph_safe=True)
            shared = synthetic_layer("fp8_block128", 1000, 1, H, I, 9)
            notes.append(experts.path_note)
            x = torch.zeros(T, H, dtype=torch.bfloat16, device="cuda")
            idx = torch.zeros(T, K, dtype=torch.int64, device="cuda")
            w = torch.zeros(T, K, dtype=torch.float32, device="cuda")
            bias = torch.zeros(T, H, dtype=torch.bfloat16, device="cuda")
            out = torch.zeros(T, H, dtype=torch.bfloat16, device="cuda")
            y = torch.zeros(E // R, R * T, H, dtype=torch.bfloat16, device="cuda")

            def load(inputs):
                xs, ids, ws = inputs[r]
                x.copy_(cuda_bf16(xs))
                idx.copy_(torch.from_numpy(ids))
                w.copy_(torch.from_numpy(ws))

            def step():
                shared.forward_dense(0, x, bias)
                d = disp.dispatch(x, idx, w, phase="decode")
                experts.forward(d, y)
                disp.combine(y, bias=bias, out=out)

            load(rounds[0])
            step()  # warm-up outside the capture: buffer outputs, cuBLASLt plans, layer scratch
            torch.cuda.current_stream().synchronize()
            barrier.wait()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=s, capture_error_mode="thread_local"):
                step()
            barrier.wait()
            got = []
            for inputs in rounds:
                load(inputs)
                torch.cuda.current_stream().synchronize()
                barrier.wait()
                graph.replay()
                torch.cuda.current_stream().synchronize()
                got.append(bits(out).copy())
                barrier.wait()
            buf.check()
            return got

    outs = run_threads(R, body)
    for i, inputs in enumerate(rounds):
        check_dense([outs[r][i] for r in range(R)], inputs, "fp8_block128", E, H, I, 9, notes[0])
    assert not np.array_equal(outs[0][0], outs[0][1]), "replays with new inputs must give new outputs"
