"""A numpy dense MoE reference for the serving tests, written independently of the library: each
token through its top-k experts in float64 from the exact inputs and the dequantized weights, with
the error model of docs/SERVING.md ("How close is close enough") propagated as a variance.

A correct layer has RMS(err) / RMS(sigma) well below 1 (about 0.5); the check passes at <= 1.5.
"""

import numpy as np

import oracle as O

U8, UB, UACC, SUB = 2.0 ** -4, 2.0 ** -8, 2.0 ** -13, 2.0 ** -10
SILU_SLOPE = 1.0999


def e4m3_values():
    return O.e4m3_decode(np.arange(256, dtype=np.uint8)).astype(np.float64)


def dequantize(w, s):
    """E4M3 codes [E, N, K] (uint8) with fp32 block scales [E, N/128, K/128] -> float64."""
    v = e4m3_values()[w]
    return v * np.repeat(np.repeat(s.astype(np.float64), 128, axis=1), 128, axis=2)


def weights_f64(weights):
    if "gate_up_scales" in weights:
        return (dequantize(weights["gate_up"], weights["gate_up_scales"]),
                dequantize(weights["down"], weights["down_scales"]))
    return (O.bf16_to_f32(weights["gate_up"]).astype(np.float64), O.bf16_to_f32(weights["down"]).astype(np.float64))


def fp8_quant_var(v, group=128):
    """Variance of the E4M3 1x128-group quantization error of rows v [n, k]."""
    n, k = v.shape
    g = np.abs(v).reshape(n, k // group, group)
    amax = np.maximum(g.max(axis=2, keepdims=True), 1e-4)
    s = 2.0 * amax / 448.0
    w = U8 * g + SUB * s
    return (w * w / 3.0).reshape(n, k)


def gemv(w, x, var_x, k, dequant=False):
    """x [n, k] @ w.T with propagated variance (accumulation, the bf16 output rounding and, when the
    GEMM ran on dequantized bf16 operands, their rounding)."""
    y = x @ w.T
    var = var_x @ (w * w).T
    mag2 = (x * x) @ (w * w).T
    u = UACC + k / 2.0 ** 24 + (2 * UB if dequant else 0.0)
    var = var + u * u * mag2 / 3.0 + (UB * y) ** 2 / 3.0
    return y, var


def ffn(w1, w2, x, var_x, fp8, dequant=False):
    h, i = w1.shape[1], w2.shape[1]
    g, var_g = gemv(w1, x, var_x, h, dequant)
    a, b = g[:, :i], g[:, i:]
    sig = 1.0 / (1.0 + np.exp(-a))
    silu = a * sig
    act = silu * b
    var_act = SILU_SLOPE ** 2 * b * b * var_g[:, :i] + silu * silu * var_g[:, i:]
    var_act = var_act + (fp8_quant_var(act) if fp8 else (UB * act) ** 2 / 3.0)
    return gemv(w2, act, var_act, i, dequant)


def moe(x_bits, idx, w, experts, fp8, shared=None, dequant=False):
    """Dense reference of one rank's tokens: x bf16 bits [T, H], idx [T, K], w [T, K] (routed scaling
    folded in); experts: (w1 [E, 2I, H], w2 [E, H, I]) float64; shared: (w1, w2) of one expert;
    dequant: the GPU ran its FP8 GEMMs on bf16-rounded dequantized operands."""
    x = O.bf16_to_f32(x_bits).astype(np.float64)
    var_x = fp8_quant_var(x) if fp8 else np.zeros_like(x)
    t, hdim = x.shape
    out = np.zeros((t, hdim))
    var = np.zeros((t, hdim))
    route_abs = np.zeros((t, hdim))
    w1, w2 = experts
    for tok in range(t):
        for k in range(idx.shape[1]):
            e = int(idx[tok, k])
            if e < 0:
                continue
            y, vy = ffn(w1[e], w2[e], x[tok:tok + 1], var_x[tok:tok + 1], fp8, dequant)
            out[tok] += w[tok, k] * y[0]
            var[tok] += float(w[tok, k]) ** 2 * vy[0]
            route_abs[tok] += np.abs(w[tok, k] * y[0])
    var += (2 * UB * route_abs) ** 2 / 3.0  # bf16 route products and per-rank partials
    if shared is not None and t:
        y, vy = ffn(shared[0][0], shared[1][0], x, var_x, fp8, dequant)
        out += y
        var += vy + (UB * y) ** 2 / 3.0
    var += (UB * out) ** 2 / 3.0  # the combine output
    return out, var


def rms_ratio(got_bits, ref, var):
    """RMS(got - ref) / RMS(sigma) over every element."""
    got = O.bf16_to_f32(got_bits).astype(np.float64)
    if got.size == 0:
        return 0.0
    assert np.isfinite(got).all()
    return float(np.sqrt(np.mean((got - ref) ** 2)) / np.sqrt(np.mean(var)))
