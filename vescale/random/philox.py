"""Philox4x32-10 and the exact number transforms of vescale.random, in pure PyTorch.

Everything here works on int64 tensors that hold unsigned 32-bit words (values in [0, 2**32)) and on
float32 / float64 tensors, and uses only operations whose result IEEE 754 fixes bit for bit: integer
arithmetic, +, -, * and / rounded to nearest, conversions, comparisons. No libm, no fused
multiply-add, nothing whose last bit could depend on vector width, compiler or CPU (so not even
torch.sqrt, which may use MKL's not-quite-correctly-rounded vector math). The compiled
kernel (csrc/vescale_rng.c) follows the same steps in the same order, so both give identical bits.

Sources of the definitions (read, not copied):
- Philox4x32-10: Salmon et al., "Parallel Random Numbers: As Easy as 1, 2, 3" (SC'11); round function
  and constants as in curand_philox4x32_x.h; checked against Random123's known-answer vectors.
- uniform words -> floats: curand's _curand_uniform (float) and _curand_uniform_double_hq (double).
- Box-Muller: curand's _curand_box_muller / _curand_box_muller_double, but with our own log, sin and
  cos (below), because CUDA's __sincosf / sincospi cannot be reproduced on a CPU.
"""

from __future__ import annotations

from fractions import Fraction
from math import factorial

import torch

MASK32 = 0xFFFFFFFF
PHILOX_M0 = 0xD2511F53  # multiplier applied to counter word 0
PHILOX_M1 = 0xCD9E8D57  # multiplier applied to counter word 2
PHILOX_W0 = 0x9E3779B9  # key bump for key word 0 (golden ratio)
PHILOX_W1 = 0xBB67AE85  # key bump for key word 1 (sqrt(3) - 1)
PHILOX_ROUNDS = 10


def _mulhilo(a, multiplier: int):
    """(high, low) 32-bit halves of a * multiplier for a in [0, 2**32), without int64 overflow.

    The 64-bit product does not fit a signed int64, so the constant is split into 16-bit halves:
    a * m = a * m_lo + (a * m_hi) << 16, each partial product below 2**48."""
    m_hi, m_lo = multiplier >> 16, multiplier & 0xFFFF
    low_part = a * m_lo
    high_part = a * m_hi
    x = low_part + ((high_part & 0xFFFF) << 16)  # < 2**49
    return (x >> 32) + (high_part >> 16), x & MASK32


def philox4x32_10(
    c0: torch.Tensor | int, c1: torch.Tensor | int, c2: torch.Tensor | int, c3: torch.Tensor | int, k0: int, k1: int
) -> tuple[torch.Tensor | int, torch.Tensor | int, torch.Tensor | int, torch.Tensor | int]:
    """Philox4x32-10 of the counter (c0, c1, c2, c3) under the key (k0, k1); returns four words.

    Counter words may be int64 tensors (broadcasting) or Python ints, each in [0, 2**32); the key is
    two Python ints in [0, 2**32). c0 is the least significant counter word, as in curand's uint4 .x."""
    for _ in range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & MASK32
        k1 = (k1 + PHILOX_W1) & MASK32
    return c0, c1, c2, c3


# ---- words -> uniform floats (curand) ---------------------------------------------------------------


def uniform_float(word: torch.Tensor) -> torch.Tensor:
    """curand_uniform: float32(word) * 2**-32 + 2**-33 in float32, a value in (0, 1].

    The word is first rounded to float32 (as CUDA's unsigned -> float conversion does); the product is
    then exact and the sum rounds once, so the result is the same with or without a fused multiply-add."""
    return word.to(torch.float32) * 2.0**-32 + 2.0**-33


def uniform_double(lo_word: torch.Tensor, hi_word: torch.Tensor) -> torch.Tensor:
    """curand_uniform2_double's per-value transform (_curand_uniform_double_hq), a value in (0, 1]:
    z = lo ^ (hi << 21) (53 bits), z * 2**-53 + 2**-54 in float64 (product exact, one rounding)."""
    z = lo_word ^ (hi_word << 21)
    return z.to(torch.float64) * 2.0**-53 + 2.0**-54


# ---- exact fused multiply-add -----------------------------------------------------------------------
# CUDA computes `rand * range + from` and `val * std + mean` with a fused multiply-add (nvcc contracts
# them by default). These functions give the correctly rounded a * b + c from plain IEEE operations.


def _two_sum(a: torch.Tensor, b: torch.Tensor):
    """s + err == a + b exactly, s = RN(a + b) (Knuth)."""
    s = a + b
    b_virtual = s - a
    return s, (a - (s - b_virtual)) + (b - b_virtual)


def _add_round_to_odd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b in float64 rounded to odd: if inexact, the neighbour of the exact sum whose last bit is 1.

    Rounding to odd at 53 bits and then to nearest at 24 (or, inside the FMA emulation, at 53 bits with
    the extra structure Boldo-Melquiond prove) never suffers from double rounding."""
    s, err = _two_sum(a, b)
    bits = s.contiguous().view(torch.int64)
    fix = (err != 0) & ((bits & 1) == 0) & torch.isfinite(s)
    away_from_zero = (err > 0) == (s > 0)  # exact sum lies beyond |s|: step the magnitude up
    bits = torch.where(fix, bits + torch.where(away_from_zero, 1, -1), bits)
    return bits.view(torch.float64)


def fma_float(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fmaf(a, b, c) for float32 inputs: the float64 product is exact, the float64 sum is rounded to odd,
    the final rounding to float32 is then correct (53 >= 2 * 24 + 2)."""
    product = a.to(torch.float64) * b.to(torch.float64)
    return _add_round_to_odd(product, c.to(torch.float64)).to(torch.float32)


_SPLITTER = 134217729.0  # 2**27 + 1 (Veltkamp)


def _two_prod(a: torch.Tensor, b: torch.Tensor):
    """p + err == a * b exactly, p = RN(a * b) (Dekker, without an FMA)."""
    p = a * b
    t = a * _SPLITTER
    a_hi = t - (t - a)
    a_lo = a - a_hi
    t = b * _SPLITTER
    b_hi = t - (t - b)
    b_lo = b - b_hi
    err = ((a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo
    return p, err


def fma_double(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fma(a, b, c) for float64 (Boldo & Melquiond, "Emulation of FMA and correctly rounded sums:
    proved algorithms using rounding to odd", IEEE TC 2008): exact product uh + ul, exact sum
    th + tl = c + uh, v = RO(tl + ul), result RN(th + v). Valid without overflow or underflow."""
    uh, ul = _two_prod(a, b)
    th, tl = _two_sum(c, uh)
    return th + _add_round_to_odd(tl, ul)


# ---- deterministic log, sin, cos in float64 -----------------------------------------------------------
# Polynomial coefficients are the exact Taylor coefficients rounded once to float64; the C kernel holds
# the same values as hexadecimal literals (tests check both against exact arithmetic).

LN2_HI = float.fromhex("0x1.62e42fefa3800p-1")  # ln 2 with 11 trailing zero bits: e * LN2_HI is exact
LN2_LO = float.fromhex("0x1.ef35793c76730p-45")  # ln 2 - LN2_HI rounded
SQRT2 = float.fromhex("0x1.6a09e667f3bcdp+0")
PIO2_HI = float.fromhex("0x1.921fb54400000p+0")  # pi / 2 with 20 trailing zero bits: q * PIO2_HI exact
PIO2_LO = float.fromhex("0x1.0b4611a626331p-34")  # pi / 2 - PIO2_HI rounded
TWO_OVER_PI = float.fromhex("0x1.45f306dc9c883p-1")
PI = float.fromhex("0x1.921fb54442d18p+1")

# log(f) = 2 atanh(s), s = (f - 1) / (f + 1): 2s + s * (s^2 * sum_k LOG_COEFFS[k] s^(2k)), |s| <= 0.172
LOG_COEFFS = tuple(float(Fraction(2, 2 * k + 1)) for k in range(1, 11))
# sin(r) = r + r * (r^2 * sum_k SIN_COEFFS[k] r^(2k)), cos(r) = 1 + r^2 * sum_k COS_COEFFS[k] r^(2k)
SIN_COEFFS = tuple(float(Fraction((-1) ** k, factorial(2 * k + 1))) for k in range(1, 9))
COS_COEFFS = tuple(float(Fraction((-1) ** k, factorial(2 * k))) for k in range(1, 10))

_EXP_MASK_SHIFT = 52
_MANTISSA_MASK = (1 << 52) - 1
_EXPONENT_ONE = 1023 << 52


def _horner(z: torch.Tensor, coeffs) -> torch.Tensor:
    acc = torch.full_like(z, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc = acc * z + c
    return acc


def det_log(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive normal float64 values, accurate to about 1 ulp, bit-reproducible."""
    bits = x.contiguous().view(torch.int64)
    exponent = (bits >> _EXP_MASK_SHIFT) - 1023
    f = ((bits & _MANTISSA_MASK) | _EXPONENT_ONE).view(torch.float64)  # in [1, 2)
    big = f > SQRT2
    f = torch.where(big, f * 0.5, f)  # now in [sqrt(1/2), sqrt(2)]
    exponent = exponent + big.to(torch.int64)
    s = (f - 1.0) / (f + 1.0)
    z = s * s
    log_f = 2.0 * s + s * (z * _horner(z, LOG_COEFFS))
    e = exponent.to(torch.float64)
    return e * LN2_HI + (e * LN2_LO + log_f)


# 1/sqrt(m) on [1, 4) ~ cubic (relative error < 0.0071), coefficients highest degree first
RSQRT_SEED = tuple(float.fromhex(h) for h in (
    "-0x1.380d65752d772p-6", "0x1.8ea094fca27b8p-3", "-0x1.7a3ae019f9bc3p-1", "0x1.8e5a731d0807bp+0"))


def det_sqrt(x: torch.Tensor) -> torch.Tensor:
    """Square root of float64 values in {0} or [2**-1000, 2**1000], within 3 ulp, bit-reproducible.

    torch.sqrt is not usable: on CPU it may go through MKL's vector math, which is accurate but not
    correctly rounded, so it can differ from C's sqrt in the last bit. Instead, with only + and *:
    x = m * 4**k with m in [1, 4); y ~ 1/sqrt(m) from a cubic (relative error < 0.0071), three Newton
    steps y <- y (3 - m y^2) / 2 (error 7.5e-5, 8.4e-9, 1.1e-16); sqrt(x) = m y 2**k (exact scaling)."""
    bits = x.contiguous().view(torch.int64)
    half_exponent = ((bits >> _EXP_MASK_SHIFT) - 1023) >> 1  # floor(e / 2)
    m = x * ((1023 - 2 * half_exponent) << _EXP_MASK_SHIFT).view(torch.float64)
    m = torch.where(x == 0, 1.0, m)  # keeps the arithmetic finite; zero is put back below
    y = ((RSQRT_SEED[0] * m + RSQRT_SEED[1]) * m + RSQRT_SEED[2]) * m + RSQRT_SEED[3]
    for _ in range(3):
        y = y * (1.5 - 0.5 * (m * y * y))
    root = (m * y) * ((1023 + half_exponent) << _EXP_MASK_SHIFT).view(torch.float64)
    return torch.where(x == 0, x, root)


def _sin_cos_reduced(r: torch.Tensor):
    z = r * r
    return r + r * (z * _horner(z, SIN_COEFFS)), 1.0 + z * _horner(z, COS_COEFFS)


def _by_quadrant(quadrant: torch.Tensor, sin_r: torch.Tensor, cos_r: torch.Tensor, want_cos: torch.Tensor):
    """sin or cos of q * pi/2 + r from sin r and cos r; want_cos selects per element."""
    q = (quadrant + want_cos.to(torch.int64)) & 3  # cos(x) = sin(x + pi/2)
    value = torch.where((q & 1) == 1, cos_r, sin_r)
    return torch.where(q >= 2, -value, value)


def det_sin_or_cos(v: torch.Tensor, want_cos: torch.Tensor) -> torch.Tensor:
    """sin(v) where want_cos is False, cos(v) where True, for float64 v in [0, 8)."""
    q = torch.round(v * TWO_OVER_PI)
    r = (v - q * PIO2_HI) - q * PIO2_LO  # the first subtraction is exact (Sterbenz)
    sin_r, cos_r = _sin_cos_reduced(r)
    return _by_quadrant(q.to(torch.int64), sin_r, cos_r, want_cos)


def det_sinpi_or_cospi(v: torch.Tensor, want_cos: torch.Tensor) -> torch.Tensor:
    """sin(pi v) / cos(pi v) for float64 v in [0, 2]; the reduction v - q/2 is exact."""
    q = torch.round(v * 2.0)
    r = (v - q * 0.5) * PI
    sin_r, cos_r = _sin_cos_reduced(r)
    return _by_quadrant(q.to(torch.int64), sin_r, cos_r, want_cos)


# ---- Box-Muller (curand's word pairing, our log / sin / cos) -------------------------------------------

_TWO_PI_F32 = 6.2831854820251465  # float32(2 pi), curand's CURAND_2PI
_V_SCALE_F32 = 2.0**-32 * _TWO_PI_F32  # CURAND_2POW32_INV_2PI, exact in float32


def normal_float(u_word: torch.Tensor, v_word: torch.Tensor, want_cos: torch.Tensor) -> torch.Tensor:
    """Standard normal float32 from a word pair as curand_normal4 pairs them (words 2i, 2i+1; element 2i
    takes the sine branch, 2i+1 the cosine): u as curand_uniform, v = fmaf(float(v_word), 2pi 2**-32,
    pi 2**-32), then sqrt(-2 log u) * sin|cos(v) in float64 (our functions), rounded to float32."""
    u = uniform_float(u_word).to(torch.float64)
    v_word_f = v_word.to(torch.float32)
    v = fma_float(v_word_f, torch.tensor(_V_SCALE_F32, dtype=torch.float32), torch.tensor(_V_SCALE_F32 / 2, dtype=torch.float32))
    radius = det_sqrt(-2.0 * det_log(u))
    return (radius * det_sin_or_cos(v.to(torch.float64), want_cos)).to(torch.float32)


def normal_double(
    w0: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, want_cos: torch.Tensor
) -> torch.Tensor:
    """Standard normal float64 as curand_normal2_double: u from (w0, w1), v = z * 2**-52 + 2**-53 from
    (w2, w3), sqrt(-2 log u) * sinpi|cospi(v) (element 0 of the pair: sin, element 1: cos)."""
    u = uniform_double(w0, w1)
    v = (w2 ^ (w3 << 21)).to(torch.float64) * 2.0**-52 + 2.0**-53
    radius = det_sqrt(-2.0 * det_log(u))
    return radius * det_sinpi_or_cospi(v, want_cos)


# ---- unsigned 64-bit remainder on int64 tensors ----------------------------------------------------------


def u64_mod(value: torch.Tensor, modulus: int) -> torch.Tensor:
    """value mod modulus, value an int64 tensor read as unsigned 64-bit, 1 <= modulus < 2**64.

    torch has no unsigned 64-bit remainder. Small moduli fold 16-bit limbs (Horner, all partial values
    below 2**63); large ones (>= 2**47, so the quotient is below 2**17) estimate the quotient in float64,
    try it and its two neighbours with an exact 96-bit comparison, and subtract (mod 2**64)."""
    if not 1 <= modulus < 2**64:
        raise ValueError(f"u64_mod: modulus must be in [1, 2**64), got {modulus}")
    hi = (value >> 32) & MASK32
    lo = value & MASK32
    if modulus < 2**47:
        rem = hi % modulus
        rem = ((rem << 16) | (lo >> 16)) % modulus
        return ((rem << 16) | (lo & 0xFFFF)) % modulus
    as_float = hi.to(torch.float64) * 2.0**32 + lo.to(torch.float64)
    q_est = torch.floor(as_float / float(modulus)).to(torch.int64)
    m_hi, m_lo = modulus >> 32, modulus & MASK32

    # q * modulus as (high, low) 32-bit limbs; q < 2**18 keeps partials < 2**50
    def times_modulus(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        low_product = q * m_lo
        return q * m_hi + (low_product >> 32), low_product & MASK32

    quotient = torch.zeros_like(value)
    for delta in (-1, 0, 1):
        q = (q_est + delta).clamp_min(0)
        prod_hi, prod_lo = times_modulus(q)
        fits = (prod_hi < hi) | ((prod_hi == hi) & (prod_lo <= lo))
        quotient = torch.where(fits, torch.maximum(quotient, q), quotient)
    prod_hi, prod_lo = times_modulus(quotient)
    diff_lo = lo - prod_lo
    borrow = (diff_lo < 0).to(torch.int64)
    diff_lo = diff_lo + (borrow << 32)
    diff_hi = hi - prod_hi - borrow  # in [0, 2**32)
    # reassemble the unsigned 64-bit remainder as int64 bits without overflowing a signed product
    diff_hi = torch.where(diff_hi >= 2**31, diff_hi - 2**32, diff_hi)
    return diff_hi * 2**32 + diff_lo
