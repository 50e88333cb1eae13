"""The Triton kernel of vescale.random: csrc/vescale_rng.c's element -> value map, one element per lane.

Loaded only by ``_triton.load`` (never imported at package import: it imports triton), once compiled for
CUDA and, on demand, once more as a separate module object under Triton's interpreter, for CPU tensors.

Every value is computed as the C kernel computes it (see the comments there and in ``philox``):
Philox4x32-10 in uint32 arithmetic, then the same IEEE float operations in the same order, with these
rules, which make each operation's result fixed by IEEE 754 alone (docs/random.md, "On CUDA"):
- the launch passes ``enable_fp_fusion=False`` (no LLVM contraction, ptxas ``--fmad=false``): every
  ``a * b + c`` is a rounded product then a rounded sum, as in C built with ``-ffp-contract=off``;
- no transcendental, no division except the float64 one in ``_det_log`` (``div.rn.f64``, correctly
  rounded), no libdevice, no float32 division (Triton's default float32 ``/`` is approximate);
- float64 constants are made with ``tl.full(..., tl.float64)`` (``_f64``): a bare Python float in Triton
  code is an fp32 constant when it fits fp32, which would round coefficients to 24 bits;
- nearbyint is the exact ``(x + 1.5 * 2**52) - 1.5 * 2**52`` (round half to even for 0 <= x < 2**51);
- float32 -> float16 / bfloat16 is the C kernel's integer rounding (out is stored through an int16 view).

Only builtins of triton.language are used, none of its ``@triton.jit`` helpers (``tl.zeros_like``,
``tl.cdiv``, ...): Triton decorates those once, when it is imported, in that moment's mode, so calling them
would tie this module to the process's TRITON_INTERPRET instead of to the mode it was loaded in.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vescale.random import philox

# ---- constants (globals used in jit code must be tl.constexpr) ----

PHILOX_M0: tl.constexpr = tl.constexpr(philox.PHILOX_M0)
PHILOX_M1: tl.constexpr = tl.constexpr(philox.PHILOX_M1)
PHILOX_W0: tl.constexpr = tl.constexpr(philox.PHILOX_W0)
PHILOX_W1: tl.constexpr = tl.constexpr(philox.PHILOX_W1)

LN2_HI: tl.constexpr = tl.constexpr(philox.LN2_HI)
LN2_LO: tl.constexpr = tl.constexpr(philox.LN2_LO)
SQRT2: tl.constexpr = tl.constexpr(philox.SQRT2)
PIO2_HI: tl.constexpr = tl.constexpr(philox.PIO2_HI)
PIO2_LO: tl.constexpr = tl.constexpr(philox.PIO2_LO)
TWO_OVER_PI: tl.constexpr = tl.constexpr(philox.TWO_OVER_PI)
PI: tl.constexpr = tl.constexpr(philox.PI)
ROUND_MAGIC: tl.constexpr = tl.constexpr(1.5 * 2.0**52)
SPLITTER: tl.constexpr = tl.constexpr(134217729.0)  # 2**27 + 1 (Veltkamp)
V_SCALE: tl.constexpr = tl.constexpr(philox._V_SCALE_F32)  # exact in float32

# Horner coefficients, highest degree first, exactly philox.py's (and the C kernel's hex literals)
LOG0: tl.constexpr = tl.constexpr(philox.LOG_COEFFS[9])
LOG1: tl.constexpr = tl.constexpr(philox.LOG_COEFFS[8])
LOG2: tl.constexpr = tl.constexpr(philox.LOG_COEFFS[7])
LOG3: tl.constexpr = tl.constexpr(philox.LOG_COEFFS[6])
LOG4: tl.constexpr = tl.constexpr(philox.LOG_COEFFS[5])
LOG5: tl.constexpr = tl.constexpr(philox.LOG_COEFFS[4])
LOG6: tl.constexpr = tl.constexpr(philox.LOG_COEFFS[3])
LOG7: tl.constexpr = tl.constexpr(philox.LOG_COEFFS[2])
LOG8: tl.constexpr = tl.constexpr(philox.LOG_COEFFS[1])
LOG9: tl.constexpr = tl.constexpr(philox.LOG_COEFFS[0])
SIN0: tl.constexpr = tl.constexpr(philox.SIN_COEFFS[7])
SIN1: tl.constexpr = tl.constexpr(philox.SIN_COEFFS[6])
SIN2: tl.constexpr = tl.constexpr(philox.SIN_COEFFS[5])
SIN3: tl.constexpr = tl.constexpr(philox.SIN_COEFFS[4])
SIN4: tl.constexpr = tl.constexpr(philox.SIN_COEFFS[3])
SIN5: tl.constexpr = tl.constexpr(philox.SIN_COEFFS[2])
SIN6: tl.constexpr = tl.constexpr(philox.SIN_COEFFS[1])
SIN7: tl.constexpr = tl.constexpr(philox.SIN_COEFFS[0])
COS0: tl.constexpr = tl.constexpr(philox.COS_COEFFS[8])
COS1: tl.constexpr = tl.constexpr(philox.COS_COEFFS[7])
COS2: tl.constexpr = tl.constexpr(philox.COS_COEFFS[6])
COS3: tl.constexpr = tl.constexpr(philox.COS_COEFFS[5])
COS4: tl.constexpr = tl.constexpr(philox.COS_COEFFS[4])
COS5: tl.constexpr = tl.constexpr(philox.COS_COEFFS[3])
COS6: tl.constexpr = tl.constexpr(philox.COS_COEFFS[2])
COS7: tl.constexpr = tl.constexpr(philox.COS_COEFFS[1])
COS8: tl.constexpr = tl.constexpr(philox.COS_COEFFS[0])
RSQRT0: tl.constexpr = tl.constexpr(philox.RSQRT_SEED[0])
RSQRT1: tl.constexpr = tl.constexpr(philox.RSQRT_SEED[1])
RSQRT2: tl.constexpr = tl.constexpr(philox.RSQRT_SEED[2])
RSQRT3: tl.constexpr = tl.constexpr(philox.RSQRT_SEED[3])

# kernel.py's op codes and _native's dtype codes (constexpr copies: jit code cannot read other modules)
OP_UNIFORM: tl.constexpr = tl.constexpr(0)
OP_NORMAL: tl.constexpr = tl.constexpr(1)
OP_BERNOULLI: tl.constexpr = tl.constexpr(2)
OP_RANDOM: tl.constexpr = tl.constexpr(3)
OP_BERNOULLI_TENSOR: tl.constexpr = tl.constexpr(4)
DT_F32: tl.constexpr = tl.constexpr(0)
DT_F64: tl.constexpr = tl.constexpr(1)
DT_F16: tl.constexpr = tl.constexpr(2)
DT_BF16: tl.constexpr = tl.constexpr(3)
DT_BOOL: tl.constexpr = tl.constexpr(4)
DT_U8: tl.constexpr = tl.constexpr(5)
DT_I8: tl.constexpr = tl.constexpr(6)
DT_I16: tl.constexpr = tl.constexpr(7)
DT_I32: tl.constexpr = tl.constexpr(8)
DT_I64: tl.constexpr = tl.constexpr(9)

# ---- Philox4x32-10 ----


@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of uint32 counter words under the uint32 key (k0, k1), as curand_philox4x32_x.h."""
    m0 = tl.full((), PHILOX_M0, tl.uint32)
    m1 = tl.full((), PHILOX_M1, tl.uint32)
    for _ in tl.static_range(10):
        x0 = c0
        x2 = c2
        c0 = tl.umulhi(m1, x2) ^ c1 ^ k0
        c2 = tl.umulhi(m0, x0) ^ c3 ^ k1
        c1 = m1 * x2
        c3 = m0 * x0
        k0 = k0 + tl.full((), PHILOX_W0, tl.uint32)
        k1 = k1 + tl.full((), PHILOX_W1, tl.uint32)
    return c0, c1, c2, c3


# ---- exact arithmetic helpers (vescale_rng.c / philox.py of the same names) ----


@triton.jit
def _f64(value: tl.constexpr):
    return tl.full((), value, tl.float64)


@triton.jit
def _bits(x):
    return x.to(tl.int64, bitcast=True)


@triton.jit
def _from_bits(b):
    return b.to(tl.float64, bitcast=True)


@triton.jit
def _rint(x):
    """nearbyint(x) for 0 <= x < 2**51: adding 1.5 * 2**52 rounds to an integer (half to even), exactly."""
    return (x + _f64(ROUND_MAGIC)) - _f64(ROUND_MAGIC)


@triton.jit
def _add_round_to_odd(a, b):
    s = a + b
    bv = s - a
    err = (a - (s - bv)) + (b - bv)
    bits = _bits(s)
    finite = (bits & 0x7FF0000000000000) != 0x7FF0000000000000
    fix = (err != 0.0) & ((bits & 1) == 0) & finite
    away_from_zero = (err > 0.0) == (s > 0.0)
    step = tl.where(away_from_zero, 1, -1).to(tl.int64)
    return _from_bits(tl.where(fix, bits + step, bits))


@triton.jit
def fma_float(a, b, c):
    """fmaf(a, b, c) of float32 values: exact float64 product, sum rounded to odd, then to float32."""
    return _add_round_to_odd(a.to(tl.float64) * b.to(tl.float64), c.to(tl.float64)).to(tl.float32)


@triton.jit
def fma_double(a, b, c):
    """fma(a, b, c) of float64 values (Boldo-Melquiond emulation, as the C kernel)."""
    p = a * b
    t = a * _f64(SPLITTER)
    ah = t - (t - a)
    al = a - ah
    t = b * _f64(SPLITTER)
    bh = t - (t - b)
    bl = b - bh
    pl = ((ah * bh - p) + ah * bl + al * bh) + al * bl
    th = c + p
    bv = th - c
    tl_ = (c - (th - bv)) + (p - bv)
    return th + _add_round_to_odd(tl_, pl)


@triton.jit
def _log_poly(z):
    acc = _f64(LOG0)
    acc = acc * z + _f64(LOG1)
    acc = acc * z + _f64(LOG2)
    acc = acc * z + _f64(LOG3)
    acc = acc * z + _f64(LOG4)
    acc = acc * z + _f64(LOG5)
    acc = acc * z + _f64(LOG6)
    acc = acc * z + _f64(LOG7)
    acc = acc * z + _f64(LOG8)
    return acc * z + _f64(LOG9)


@triton.jit
def _sin_poly(z):
    acc = _f64(SIN0)
    acc = acc * z + _f64(SIN1)
    acc = acc * z + _f64(SIN2)
    acc = acc * z + _f64(SIN3)
    acc = acc * z + _f64(SIN4)
    acc = acc * z + _f64(SIN5)
    acc = acc * z + _f64(SIN6)
    return acc * z + _f64(SIN7)


@triton.jit
def _cos_poly(z):
    acc = _f64(COS0)
    acc = acc * z + _f64(COS1)
    acc = acc * z + _f64(COS2)
    acc = acc * z + _f64(COS3)
    acc = acc * z + _f64(COS4)
    acc = acc * z + _f64(COS5)
    acc = acc * z + _f64(COS6)
    acc = acc * z + _f64(COS7)
    return acc * z + _f64(COS8)


@triton.jit
def det_log(x):
    """Natural log of positive normal float64 values (philox.det_log)."""
    bits = _bits(x)
    exponent = (bits >> 52) - 1023
    f = _from_bits((bits & 0xFFFFFFFFFFFFF) | 0x3FF0000000000000)  # in [1, 2)
    big = f > _f64(SQRT2)
    f = tl.where(big, f * _f64(0.5), f)
    exponent = exponent + big.to(tl.int64)
    s = (f - _f64(1.0)) / (f + _f64(1.0))
    z = s * s
    log_f = _f64(2.0) * s + s * (z * _log_poly(z))
    e = exponent.to(tl.float64)
    return e * _f64(LN2_HI) + (e * _f64(LN2_LO) + log_f)


@triton.jit
def det_sqrt(x):
    """Square root of float64 values in {0} or [2**-1000, 2**1000] (philox.det_sqrt)."""
    half_exponent = ((_bits(x) >> 52) - 1023) >> 1  # floor(e / 2): arithmetic shift
    m = x * _from_bits((1023 - 2 * half_exponent) << 52)
    m = tl.where(x == 0.0, _f64(1.0), m)
    y = ((_f64(RSQRT0) * m + _f64(RSQRT1)) * m + _f64(RSQRT2)) * m + _f64(RSQRT3)
    for _ in tl.static_range(3):
        y = y * (_f64(1.5) - _f64(0.5) * (m * y * y))
    root = (m * y) * _from_bits((1023 + half_exponent) << 52)
    return tl.where(x == 0.0, x, root)


@triton.jit
def _by_quadrant(quadrant, r, want_cos):
    z = r * r
    sin_r = r + r * (z * _sin_poly(z))
    cos_r = _f64(1.0) + z * _cos_poly(z)
    q = (quadrant + want_cos) & 3
    value = tl.where((q & 1) == 1, cos_r, sin_r)
    return tl.where(q >= 2, -value, value)


@triton.jit
def det_sin_or_cos(v, want_cos):
    """sin(v) (want_cos 0) or cos(v) (want_cos 1) for float64 v in [0, 8)."""
    q = _rint(v * _f64(TWO_OVER_PI))
    r = (v - q * _f64(PIO2_HI)) - q * _f64(PIO2_LO)
    return _by_quadrant(q.to(tl.int64), r, want_cos)


@triton.jit
def det_sinpi_or_cospi(v, want_cos):
    """sin(pi v) / cos(pi v) for float64 v in [0, 2]."""
    q = _rint(v * _f64(2.0))
    r = (v - q * _f64(0.5)) * _f64(PI)
    return _by_quadrant(q.to(tl.int64), r, want_cos)


@triton.jit
def uniform_float(w):
    """curand_uniform: float32(w) * 2**-32 + 2**-33 (product exact, one rounding)."""
    return w.to(tl.float32) * tl.full((), 2.0**-32, tl.float32) + tl.full((), 2.0**-33, tl.float32)


@triton.jit
def uniform_double(lo, hi):
    """_curand_uniform_double_hq: z = lo ^ (hi << 21) < 2**53 (converted exactly), z * 2**-53 + 2**-54."""
    z = lo.to(tl.uint64) ^ (hi.to(tl.uint64) << 21)
    return z.to(tl.float64) * _f64(2.0**-53) + _f64(2.0**-54)


# ---- float32 -> float16 / bfloat16 bits, round to nearest even (vescale_rng.c f32_to_f16 / f32_to_bf16) ----


@triton.jit
def _f32_to_f16_bits(f):
    x = f.to(tl.uint32, bitcast=True)
    sign = (x >> 16) & 0x8000
    ax = x & 0x7FFFFFFF
    t = tl.abs(f) + tl.full((), 0.5, tl.float32)  # rounds |f| < 2**-14 to a multiple of 2**-24, ties to even
    subnormal = sign | (t.to(tl.uint32, bitcast=True) - 0x3F000000)
    odd = (ax >> 13) & 1
    normal = sign | ((ax - (112 << 23) + 0xFFF + odd) >> 13)
    h = tl.where(ax < 0x38800000, subnormal, normal)
    h = tl.where(ax >= 0x477FF000, sign | 0x7C00, h)
    h = tl.where(ax > 0x7F800000, sign | 0x7E00, h)
    return (h & 0xFFFF).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _f32_to_bf16_bits(f):
    x = f.to(tl.uint32, bitcast=True)
    h = (x + 0x7FFF + ((x >> 16) & 1)) >> 16
    h = tl.where((x & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, h)
    return (h & 0xFFFF).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _half_bits(v, DTYPE: tl.constexpr):
    if DTYPE == DT_F16:
        return _f32_to_f16_bits(v)
    else:
        return _f32_to_bf16_bits(v)


@triton.jit
def _half_equal(x, y):
    """== of two non-NaN half bit patterns (+0 == -0)."""
    return (x == y) | (((x & 0x7FFF) == 0) & ((y & 0x7FFF) == 0))


# ---- stores (vescale_rng.c store_float32_values / store_int64_values) ----


@triton.jit
def _store_float32(out_ptr, e, mask, v, frm, to, UNIFORM: tl.constexpr, DTYPE: tl.constexpr):
    """float32 values into out (float32, or float16 / bfloat16 bits through an int16 view); a uniform value
    equal to `to` in the output dtype becomes `from`."""
    if DTYPE == DT_F32:
        if UNIFORM:
            v = tl.where(v == to, frm, v)
        tl.store(out_ptr + e, v, mask=mask)
    else:
        h = _half_bits(v, DTYPE)
        if UNIFORM:
            h_to = _half_bits(to, DTYPE)
            h = tl.where(_half_equal(h, h_to), _half_bits(frm, DTYPE), h)
        tl.store(out_ptr + e, h, mask=mask)


@triton.jit
def _store_int64(out_ptr, e, mask, v, DTYPE: tl.constexpr):
    """int64 values into out's dtype as C casts them (floats round to nearest, integers wrap)."""
    if DTYPE == DT_F32:
        tl.store(out_ptr + e, v.to(tl.float32), mask=mask)
    elif DTYPE == DT_F64:
        tl.store(out_ptr + e, v.to(tl.float64), mask=mask)
    elif DTYPE == DT_F16 or DTYPE == DT_BF16:
        tl.store(out_ptr + e, _half_bits(v.to(tl.float32), DTYPE), mask=mask)
    elif DTYPE == DT_BOOL:
        tl.store(out_ptr + e, (v != 0).to(tl.uint8), mask=mask)  # out viewed as uint8
    elif DTYPE == DT_U8:
        tl.store(out_ptr + e, v.to(tl.uint8), mask=mask)
    elif DTYPE == DT_I8:
        tl.store(out_ptr + e, v.to(tl.int8), mask=mask)
    elif DTYPE == DT_I16:
        tl.store(out_ptr + e, v.to(tl.int16), mask=mask)
    elif DTYPE == DT_I32:
        tl.store(out_ptr + e, v.to(tl.int32), mask=mask)
    else:
        tl.store(out_ptr + e, v, mask=mask)


# ---- the kernel ----


@triton.jit
def _select4(ii, w0, w1, w2, w3):
    return tl.where(ii == 0, w0, tl.where(ii == 1, w1, tl.where(ii == 2, w2, w3)))


@triton.jit
def fill_kernel(
    out_ptr, prob_ptr, row_base_ptr, inner_off_ptr, launch_ptr, int_ptr, float_ptr,
    OP: tl.constexpr, WIDE: tl.constexpr, UNROLL: tl.constexpr, DTYPE: tl.constexpr,
    NLAUNCH: tl.constexpr, IDENTITY: tl.constexpr, BLOCK: tl.constexpr,
):
    """One lane per local element e (C order): global index j = row_base[r] + inner_off[p] + c for
    e = (r * ninner + p) * run + c (_native.local_layout), its launch, thread and step as in
    kernel.py, then Philox and the op's transform.

    launch_ptr: int64 [start_0..start_{n-1}, numel, threads_0.., counter_0..] (NLAUNCH launches);
    int_ptr: int64 [key0, key1, modulus (uint64 bits), base, ninner, run, local numel];
    float_ptr: float64 [a, b, c] (Draw's fields)."""
    key0 = tl.load(int_ptr + 0).to(tl.uint32)
    key1 = tl.load(int_ptr + 1).to(tl.uint32)
    ninner = tl.load(int_ptr + 4)
    run = tl.load(int_ptr + 5)
    total = tl.load(int_ptr + 6)
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = e < total
    r = e // (ninner * run)
    rest = e - r * (ninner * run)
    p = rest // run
    c = rest - p * run
    j = tl.load(row_base_ptr + r, mask=mask, other=0) + tl.load(inner_off_ptr + p, mask=mask, other=0) + c

    if OP == OP_BERNOULLI_TENSOR:  # bernoulli_tensor_cuda_kernel: word j % 4 of thread j / 4's first call
        counter = tl.load(launch_ptr + 2 * NLAUNCH + 1) + j * 0
        t = j >> 2
        ii = j & 3
    else:
        s = j * 0
        for i in tl.static_range(1, NLAUNCH):  # tensors split for 32-bit indexing: which launch holds j
            s += (j >= tl.load(launch_ptr + i)).to(tl.int64)
        threads = tl.load(launch_ptr + NLAUNCH + 1 + s)
        local = j - tl.load(launch_ptr + s)
        step = local // threads
        t = local - step * threads
        ii = step % UNROLL
        counter = tl.load(launch_ptr + 2 * NLAUNCH + 1 + s) + step // UNROLL
    w0, w1, w2, w3 = philox4x32_10(
        (counter & 0xFFFFFFFF).to(tl.uint32), (counter >> 32).to(tl.uint32),
        (t & 0xFFFFFFFF).to(tl.uint32), (t >> 32).to(tl.uint32), key0, key1,
    )
    a = tl.load(float_ptr + 0)
    b = tl.load(float_ptr + 1)
    cc = tl.load(float_ptr + 2)
    second = ii != 0  # U = 2: the element's word pair is (w2, w3) for ii = 1, else (w0, w1)
    x_pair = tl.where(second, w2, w0)
    y_pair = tl.where(second, w3, w1)

    if OP == OP_UNIFORM:
        if WIDE:
            v = uniform_double(x_pair, y_pair)
            if not IDENTITY:
                v = fma_double(v, b, a)
            tl.store(out_ptr + e, tl.where(v == cc, a, v), mask=mask)
        else:
            v = uniform_float(_select4(ii, w0, w1, w2, w3))
            if not IDENTITY:
                v = fma_float(v, b.to(tl.float32), a.to(tl.float32))
            _store_float32(out_ptr, e, mask, v, a.to(tl.float32), cc.to(tl.float32), True, DTYPE)
    elif OP == OP_NORMAL:
        want_cos = (ii & 1).to(tl.int64)  # the cosine element of its Box-Muller pair
        if WIDE:  # curand_normal2_double: u from (w0, w1), v from (w2, w3)
            radius = det_sqrt(_f64(-2.0) * det_log(uniform_double(w0, w1)))
            zbits = w2.to(tl.uint64) ^ (w3.to(tl.uint64) << 21)
            angle = zbits.to(tl.float64) * _f64(2.0**-52) + _f64(2.0**-53)
            z = radius * det_sinpi_or_cospi(angle, want_cos)
            if IDENTITY:
                z = z + _f64(0.0)
            else:
                z = fma_double(z, b, a)
            tl.store(out_ptr + e, z, mask=mask)
        else:  # curand_normal4: words (0, 1) feed elements 0 (sin), 1 (cos); (2, 3) feed 2 and 3
            pair = ii >= 2
            u_word = tl.where(pair, w2, w0)
            v_word = tl.where(pair, w3, w1)
            radius = det_sqrt(_f64(-2.0) * det_log(uniform_float(u_word).to(tl.float64)))
            scale = tl.full((), V_SCALE, tl.float32)
            angle = fma_float(v_word.to(tl.float32), scale, scale * tl.full((), 0.5, tl.float32))
            z = (radius * det_sin_or_cos(angle.to(tl.float64), want_cos)).to(tl.float32)
            if IDENTITY:
                z = z + tl.full((), 0.0, tl.float32)
            else:
                z = fma_float(z, b.to(tl.float32), a.to(tl.float32))
            _store_float32(out_ptr, e, mask, z, z, z, False, DTYPE)
    elif OP == OP_BERNOULLI:
        if WIDE:
            keep = uniform_double(x_pair, y_pair) < a
        else:
            keep = uniform_float(_select4(ii, w0, w1, w2, w3)) < a.to(tl.float32)
        _store_int64(out_ptr, e, mask, keep.to(tl.int64), DTYPE)
    elif OP == OP_BERNOULLI_TENSOR:  # u <= p in the probabilities' type (float64 for a float64 result)
        u = uniform_float(_select4(ii, w0, w1, w2, w3))
        if DTYPE == DT_F64:
            keep = u.to(tl.float64) <= tl.load(prob_ptr + e, mask=mask, other=0.0)
        else:
            keep = u <= tl.load(prob_ptr + e, mask=mask, other=0.0)
        _store_int64(out_ptr, e, mask, keep.to(tl.int64), DTYPE)
    else:  # OP_RANDOM: (bits % modulus) + base in uint64 arithmetic, modulus 0 meaning 2**64
        modulus = tl.load(int_ptr + 2).to(tl.uint64, bitcast=True)
        base = tl.load(int_ptr + 3).to(tl.uint64, bitcast=True)
        if WIDE:  # random_from_to's 64-bit draw: the first word of the pair is the high half
            bits = (x_pair.to(tl.uint64) << 32) | y_pair.to(tl.uint64)
            safe = tl.where(modulus == 0, tl.full((), 1, tl.uint64), modulus)
            bits = tl.where(modulus == 0, bits, bits % safe)
        else:
            bits = _select4(ii, w0, w1, w2, w3).to(tl.uint64) % modulus
        _store_int64(out_ptr, e, mask, (bits + base).to(tl.int64, bitcast=True), DTYPE)
