"""Known answers for the Philox4x32-10 core and exactness of the number transforms (vescale.random.philox).

The Philox vectors are Random123's tests/kat_vectors, "philox4x32 10" lines (counter words, key words,
expected output words, hexadecimal). Float transforms are checked against exact rational arithmetic."""

import math
import random
from fractions import Fraction
from math import factorial

import numpy as np
import pytest
import torch

from vescale.random import philox

KAT_PHILOX4X32_10 = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", KAT_PHILOX4X32_10)
def test_philox_known_answers_on_tensors(counter, key, expected):
    words = philox.philox4x32_10(*[torch.tensor([c], dtype=torch.int64) for c in counter], *key)
    assert [int(w) for w in words] == list(expected)


@pytest.mark.parametrize("counter, key, expected", KAT_PHILOX4X32_10)
def test_philox_known_answers_on_python_ints(counter, key, expected):
    assert list(philox.philox4x32_10(*counter, *key)) == list(expected)


def test_compiled_philox_known_answers(native_kernel):
    native = native_kernel
    rows = KAT_PHILOX4X32_10 * 30  # 90 counters: the 8-wide vector lanes and the scalar tail
    counters = [torch.tensor([counter[i] for counter, _, _ in rows]) for i in range(4)]
    for counter, key, expected in KAT_PHILOX4X32_10:
        words = native.philox(*counters, *key)
        assert torch.equal(words, torch.stack(philox.philox4x32_10(*counters, *key), dim=1))
        for row, (row_counter, _, _) in enumerate(rows):
            if row_counter == counter:
                assert words[row].tolist() == list(expected)


def test_philox_batched_equals_one_by_one():
    gen = torch.Generator().manual_seed(0)
    counters = [torch.randint(0, 2**32, (64,), generator=gen) for _ in range(4)]
    key = (0x12345678, 0x9ABCDEF0)
    batched = philox.philox4x32_10(*counters, *key)
    for i in range(0, 64, 7):
        single = philox.philox4x32_10(*[int(c[i]) for c in counters], *key)
        assert [int(w[i]) for w in batched] == list(single)
    assert all(w.dtype == torch.int64 and int(w.min()) >= 0 and int(w.max()) < 2**32 for w in batched)


def test_uniform_float_formula_and_range():
    words = torch.tensor([0, 1, 2**24 + 1, 2**31, 2**32 - 129, 2**32 - 1], dtype=torch.int64)
    u = philox.uniform_float(words)
    assert u.dtype == torch.float32
    # float32(word) rounds first (2**24 + 1 -> 2**24, 2**32 - 129 -> 2**32 - 256 ... ), then one rounding
    expected = [np.float32(np.float32(w) * np.float32(2.0**-32) + np.float32(2.0**-33)) for w in words.tolist()]
    assert u.tolist() == [float(e) for e in expected]
    assert u[0].item() == 2.0**-33 and u[-1].item() == 1.0  # (0, 1]


def test_uniform_double_formula_and_range():
    lo = torch.tensor([0, 2**21 - 1, 12345, 2**32 - 1], dtype=torch.int64)  # 2**21 - 1: z = 2**53 - 1
    hi = torch.tensor([0, 2**32 - 1, 678, 2**32 - 1], dtype=torch.int64)
    u = philox.uniform_double(lo, hi)
    for i in range(4):
        z = lo[i].item() ^ (hi[i].item() << 21)  # 53 random bits
        assert u[i].item() == float(Fraction(2 * z + 1, 2**54))  # correctly rounded (2z + 1) / 2**54
    assert u[0].item() == 2.0**-54 and u[1].item() == 1.0


def _exact_float32(value: Fraction) -> float:
    """value rounded to the nearest float32, ties to even (checked against both neighbours)."""
    x = np.float32(float(value))
    candidates = [np.nextafter(x, np.float32(-np.inf)), x, np.nextafter(x, np.float32(np.inf))]
    return float(min(candidates, key=lambda c: (abs(Fraction(float(c)) - value), int(np.array(c).view(np.int32)) & 1)))


def _fma_cases(rng: random.Random, n: int, to_float32: bool):
    """Random operands plus near-cancelling and near-tie ones, where a non-fused or double-rounded
    evaluation goes wrong."""
    def number():
        x = rng.uniform(-1, 1) * 2.0 ** rng.randint(-20, 20)
        return float(np.float32(x)) if to_float32 else x

    cases = []
    for i in range(n):
        a, b = number(), number()
        product = a * b
        kind = i % 3
        if kind == 0:
            c = number()
        elif kind == 1:  # c nearly cancels a * b: the low bits of the exact product decide
            c = -product * rng.choice([1.0, 1 + 2.0**-20, 1 - 2.0**-20])
        else:  # the exact sum sits near a rounding midpoint
            c = rng.choice([-1, 1]) * abs(product) + math.ulp(product) * rng.choice([0.5, -0.5, 1.5])
        if to_float32:
            c = float(np.float32(c))
        cases.append((a, b, c))
    return cases


def test_fma_float_is_correctly_rounded():
    cases = _fma_cases(random.Random(1), 3000, to_float32=True)
    a, b, c = (torch.tensor(col, dtype=torch.float32) for col in zip(*cases))
    got = philox.fma_float(a, b, c).tolist()
    for (x, y, z), r in zip(cases, got):
        assert r == _exact_float32(Fraction(x) * Fraction(y) + Fraction(z)), (x, y, z)


def test_fma_double_is_correctly_rounded():
    cases = _fma_cases(random.Random(2), 3000, to_float32=False)
    a, b, c = (torch.tensor(col, dtype=torch.float64) for col in zip(*cases))
    got = philox.fma_double(a, b, c).tolist()
    for (x, y, z), r in zip(cases, got):
        assert r == float(Fraction(x) * Fraction(y) + Fraction(z)), (x, y, z)  # Fraction -> float rounds correctly


def test_polynomial_coefficients_are_the_rounded_taylor_coefficients():
    assert philox.LOG_COEFFS == tuple(float(Fraction(2, 2 * k + 1)) for k in range(1, 11))
    assert philox.SIN_COEFFS == tuple(float(Fraction((-1) ** k, factorial(2 * k + 1))) for k in range(1, 9))
    assert philox.COS_COEFFS == tuple(float(Fraction((-1) ** k, factorial(2 * k))) for k in range(1, 10))


def test_split_constants_against_high_precision():
    mp = pytest.importorskip("mpmath")
    mp.mp.prec = 200
    assert philox.LN2_HI + philox.LN2_LO == float(mp.log(2))
    assert float(mp.mpf(philox.LN2_HI) + mp.mpf(philox.LN2_LO) - mp.log(2)) < 2.0**-95
    assert Fraction(philox.LN2_HI).denominator <= 2**42  # e * LN2_HI exact for |e| < 2**11
    assert float(mp.mpf(philox.PIO2_HI) + mp.mpf(philox.PIO2_LO) - mp.pi / 2) < 2.0**-85
    assert Fraction(philox.PIO2_HI).denominator <= 2**32  # q * PIO2_HI exact for q <= 4
    assert philox.TWO_OVER_PI == float(2 / mp.pi) and philox.PI == float(mp.pi) and philox.SQRT2 == float(mp.sqrt(2))


def test_deterministic_log_sin_cos_accuracy():
    # The values are ours (bit-defined); accuracy only needs to be close to the true functions.
    mp = pytest.importorskip("mpmath")
    rng = random.Random(3)
    xs = [rng.uniform(2.0**-54, 1.0) for _ in range(300)] + [2.0**-54, 2.0**-33, 0.5, 1.0 - 2.0**-53, 1.0]
    logs = philox.det_log(torch.tensor(xs, dtype=torch.float64)).tolist()
    for x, got in zip(xs, logs):
        exact = float(mp.log(mp.mpf(x)))
        assert abs(got - exact) <= 2 * math.ulp(exact), x  # log(1) = 0 exactly: ulp(0) is tiny
    roots = [rng.uniform(0.0, 80.0) for _ in range(300)] + [0.0, 2.0**-1000, 1.0, 2.0, 4.0 - 2.0**-50, 2.0**1000]
    got = philox.det_sqrt(torch.tensor(roots, dtype=torch.float64)).tolist()
    assert all(abs(g - math.sqrt(x)) <= 3 * math.ulp(math.sqrt(x)) for g, x in zip(got, roots))
    vs = [rng.uniform(0.0, 2 * math.pi) for _ in range(300)] + [1e-9, math.pi / 4, math.pi / 2, math.pi]
    for want_cos, fn in ((False, mp.sin), (True, mp.cos)):
        got = philox.det_sin_or_cos(torch.tensor(vs, dtype=torch.float64), torch.full((len(vs),), want_cos))
        assert max(abs(g - float(fn(mp.mpf(v)))) for g, v in zip(got.tolist(), vs)) <= 2.0**-52
    ps = [rng.uniform(0.0, 2.0) for _ in range(300)] + [2.0**-53, 0.25, 0.5, 1.0, 2.0]
    for want_cos, fn in ((False, mp.sinpi), (True, mp.cospi)):
        got = philox.det_sinpi_or_cospi(torch.tensor(ps, dtype=torch.float64), torch.full((len(ps),), want_cos))
        assert max(abs(g - float(fn(mp.mpf(v)))) for g, v in zip(got.tolist(), ps)) <= 2.0**-52


def test_u64_mod_matches_python_integers():
    rng = random.Random(4)
    values = [rng.getrandbits(64) for _ in range(2000)] + [0, 1, 2**63 - 1, 2**63, 2**64 - 1]
    as_int64 = torch.tensor([v - 2**64 if v >= 2**63 else v for v in values], dtype=torch.int64)
    for modulus in (1, 2, 3, 2**28, 2**31 + 11, 2**32 + 5, 2**47 - 1, 2**47, 2**53 + 1, 2**63, 2**63 + 7, 2**64 - 1):
        got = [r % 2**64 for r in philox.u64_mod(as_int64, modulus).tolist()]
        assert got == [v % modulus for v in values], modulus
    with pytest.raises(ValueError, match="modulus"):
        philox.u64_mod(as_int64, 0)
