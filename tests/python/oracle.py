"""A numpy oracle of SEMANTICS.md, written for these tests independently of the library.

Everything here is plain numpy: bf16 round-to-nearest-even, E4M3 encoding, the fp8 quantizer, the
dispatch layouts and the combine reduction (with a correctly rounded fmaf).
"""

import numpy as np

F32 = np.float32
F64 = np.float64


# ---- scalar formats ------------------------------------------------------------------------------

def f32_to_bf16(x):
    """float32 array -> bf16 bits (uint16), round to nearest even; every NaN -> 0x7fc0 (SEMANTICS)."""
    x = np.ascontiguousarray(x, dtype=F32)
    b = x.view(np.uint32).astype(np.uint64)
    rounded = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    return np.where(nan, np.uint16(0x7FC0), rounded).astype(np.uint16)


def bf16_to_f32(bits):
    """bf16 bits (uint16) -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(F32)


def e4m3_encode(v):
    """float32 array -> OCP E4M3 bits (uint8): RNE, subnormals down to 2^-9, saturating to +-448."""
    v = np.asarray(v, dtype=F32).astype(F64)
    sign = (np.signbit(v)).astype(np.uint8) << 7
    a = np.abs(v)
    nan = np.isnan(a)
    a = np.where(nan, 0.0, a)
    # quantum: 2^(e-3) for normals (e = floor(log2 a) >= -6), 2^-9 for subnormals
    _, ex = np.frexp(np.where(a > 0, a, 1.0))
    e = np.maximum(ex - 1, -6)
    quantum = np.ldexp(1.0, e - 3)
    q = np.rint(a / quantum) * quantum  # exact: a / 2^k; np.rint rounds half to even
    q = np.minimum(q, 448.0)
    # encode q (exactly representable now)
    _, qx = np.frexp(np.where(q > 0, q, 1.0))
    qe = qx - 1
    normal = q >= 2.0 ** -6
    mant_n = np.where(normal, q / np.ldexp(1.0, qe) * 8 - 8, 0).astype(np.int64)
    bits_n = ((qe + 7) << 3) | mant_n
    bits_s = (q / 2.0 ** -9).astype(np.int64)
    bits = np.where(normal, bits_n, bits_s).astype(np.uint8)
    bits = np.where(nan, 0x7F, bits).astype(np.uint8)
    return bits | sign


def e4m3_decode(bits):
    """E4M3 bits -> float32 (for readable assertions)."""
    b = np.asarray(bits, dtype=np.uint8).astype(np.int64)
    s = np.where(b & 0x80, -1.0, 1.0)
    e = (b >> 3) & 0xF
    m = b & 7
    val = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8.0) * np.ldexp(1.0, e - 7))
    val = np.where((e == 15) & (m == 7), np.nan, val)
    return (s * val).astype(F32)


def fmaf(a, b, c):
    """Correctly rounded float32 fused multiply-add, elementwise (numpy has none).

    a*b is exact in float64; the float64 sum s plus its TwoSum error is the exact value. Rounding s
    to float32 is then right except when s sits exactly on a float32 midpoint, where the error term
    breaks the tie.
    """
    a = np.asarray(a, F32)
    b = np.asarray(b, F32)
    c = np.asarray(c, F32)
    p = a.astype(F64) * b.astype(F64)
    c64 = c.astype(F64)
    s = p + c64
    bp = s - c64
    err = (p - bp) + (c64 - (s - bp))
    r = s.astype(F32)
    up = np.nextafter(r, F32(np.inf))
    dn = np.nextafter(r, F32(-np.inf))
    r64 = r.astype(F64)
    mid_up = (r64 + up.astype(F64)) / 2
    mid_dn = (r64 + dn.astype(F64)) / 2
    out = np.where((s == mid_up) & (err > 0), up, r)
    out = np.where((s == mid_dn) & (err < 0), dn, out)
    return out.astype(F32)


# ---- quantizer -----------------------------------------------------------------------------------

def group_size(fmt):
    return 32 if fmt == "ue8m0_g32" else 128


def scale_columns(fmt, hidden):
    groups = -(-hidden // group_size(fmt))
    return groups if fmt == "f32_g128" else -(-groups // 4)


def quantize(x_bits, fmt):
    """bf16 rows [T, H] -> (fp8 bits [T, H] uint8, scales [T, cols] fp32 or int32), per SEMANTICS.md."""
    x = bf16_to_f32(x_bits).reshape(x_bits.shape)
    t, h = x.shape
    g = group_size(fmt)
    xg = x.reshape(t, h // g, g)
    amax = np.maximum(np.abs(xg).max(axis=2) if t else np.zeros((0, h // g), F32), F32(1e-4)).astype(F32)
    if fmt == "f32_g128":
        scale = (amax.astype(F64) / 448.0).astype(F32)  # IEEE fp32 division (double rounding is exact here)
        inv = (448.0 / amax.astype(F64)).astype(F32)
        q = e4m3_encode((xg.astype(F64) * inv[:, :, None].astype(F64)).astype(F32)).reshape(t, h)
        return q, scale
    quot = (amax.astype(F64) / 448.0).astype(F32)
    qb = quot.view(np.uint32)
    exp = ((qb >> 23) & 0xFF).astype(np.int64) + ((qb & 0x7FFFFF) != 0)
    factor = np.ldexp(1.0, -(exp - 127))
    q = e4m3_encode((xg.astype(F64) * factor[:, :, None]).astype(F32)).reshape(t, h)
    groups = h // g
    words = scale_columns(fmt, h)
    packed = np.zeros((t, words), np.uint32)
    for gi in range(groups):
        packed[:, gi // 4] |= exp[:, gi].astype(np.uint32) << np.uint32(8 * (gi % 4))
    return q, packed.view(np.int32)


# ---- dispatch / combine --------------------------------------------------------------------------

def round_up(n, a):
    return -(-n // a) * a


class Case:
    """Inputs of every rank and the buffer's configuration.

    ranks[s] = dict(x=bf16 bits [T,H] or fp8 bits, scales=None or [T, cols], idx=[T,K], w=[T,K] or None)
    """

    def __init__(self, num_ranks, num_experts, num_topk, hidden, capacity, payload="bf16", scale_format="f32_g128"):
        self.R, self.E, self.K, self.H, self.C = num_ranks, num_experts, num_topk, hidden, capacity
        self.payload, self.fmt = payload, scale_format
        self.El = num_experts // num_ranks
        self.ranks = []


def wire_rows(case, s):
    """What rank s puts on the wire per token: (payload bits [T,H], scales or None)."""
    inp = case.ranks[s]
    if case.payload == "bf16":
        return inp["x"], None
    if inp.get("scales") is not None:  # pre-quantized: moved as is
        return inp["x"], inp["scales"]
    return quantize(inp["x"], case.fmt)


def dispatch(case, d, layout="contiguous", alignment=1, host_sync=True):
    """Expected outputs of rank d. Returns dict with rows (list of (s, t, k, l)), positions, tensors."""
    R, El, C = case.R, case.El, case.C
    routes = [[] for _ in range(El)]  # per local expert: (s, t, k), (s, t) ascending
    for s in range(R):
        idx = np.asarray(case.ranks[s]["idx"]).astype(np.int64)
        for t in range(idx.shape[0]):
            for k in range(case.K):
                e = int(idx[t, k])
                if e >= 0 and e // El == d:
                    routes[e % El].append((s, t, k))
    counts = np.array([len(r) for r in routes], np.int32)
    starts = [0]
    for l in range(El):
        starts.append(starts[-1] + (round_up(counts[l], alignment) if layout == "contiguous" else 0))
    rc = R * C
    if layout == "contiguous":
        m = starts[-1]
        m_cap = R * C * min(case.K, El) + El * (alignment - 1)
        rows = m if host_sync else m_cap
    row_of = {}
    for l in range(El):
        for pos, (s, t, k) in enumerate(routes[l]):
            row_of[(s, t, k)] = (starts[l] + pos) if layout == "contiguous" else (l, pos)
    out = dict(counts=counts, routes=routes, row_of=row_of)
    if layout == "contiguous":
        out["offsets"] = np.array(starts, np.int32)
        out["num_rows"] = m if host_sync else -1
        out["rows"] = rows
        out["m"] = m
    return out


def expected_rows(case, exp, d):
    """Per real row: (row index or (l, pos), payload bits, scales row or None, weight, src, l)."""
    wires = [wire_rows(case, s) for s in range(case.R)]
    res = []
    for l, rl in enumerate(exp["routes"]):
        for s, t, k in rl:
            x, sc = wires[s]
            w = case.ranks[s].get("w_sent", case.ranks[s].get("w"))
            weight = F32(0.0) if w is None else F32(np.asarray(w)[t, k])
            res.append((exp["row_of"][(s, t, k)], x[t], None if sc is None else sc[t], weight, s * case.C + t, l))
    return res


def combine(case, s, ys, exps, weighted=True, bias=None):
    """Expected combine output of rank s: [T_s, H] bf16 bits. ys[d]: rank d's y (bf16 bits, the shape
    of its recv_x); exps[d]: dispatch(case, d, ...) for the same layout."""
    idx = np.asarray(case.ranks[s]["idx"]).astype(np.int64)
    w = case.ranks[s].get("w")
    T, H, El = idx.shape[0], case.H, case.El
    out = np.zeros((T, H), np.uint16)
    for t in range(T):
        dests = []
        for k in range(case.K):
            e = int(idx[t, k])
            if e >= 0 and e // El not in dests:
                dests.append(e // El)
        acc = bf16_to_f32(bias[t]) if bias is not None else np.zeros(H, F32)
        for dd in dests:
            p = np.zeros(H, F32)
            for k in range(case.K):
                e = int(idx[t, k])
                if e < 0 or e // El != dd:
                    continue
                wk = F32(np.asarray(w)[t, k]) if weighted else F32(1.0)
                row = exps[dd]["row_of"][(s, t, k)]
                yrow = ys[dd][row] if not isinstance(row, tuple) else ys[dd][row[0], row[1]]
                p = fmaf(np.full(H, wk, F32), bf16_to_f32(yrow), p)
            partial = bf16_to_f32(f32_to_bf16(p))
            acc = (acc + partial).astype(F32)
        out[t] = f32_to_bf16(acc)
    return out
