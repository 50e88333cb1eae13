"""vescale.random.kernel: launch geometry, offset increments, the element -> Philox counter mapping,
the transforms, block (subset) generation, and the compiled kernel against the PyTorch path.

Values are compared bit for bit (torch.equal); the only tolerances are for statistics and for
normal values printed by CUDA in public PyTorch issues (4 decimals)."""

import math
import random

import numpy as np
import pytest
import torch

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vescale.random import _native, philox
from vescale.random.kernel import A100, H100_SXM, DeviceProfile, generate, offset_increment

# Skipped only where the platform has no C compiler; with one, backend="native" loads the kernel with
# required=True, so a build or load failure fails these tests instead of skipping them.
needs_native = pytest.mark.skipif(
    not _native.has_compiler(), reason="no C compiler on this platform ($CC or cc): the compiled RNG kernel cannot be built here"
)
# Formula tests run on both implementations.
BACKENDS = ["torch", pytest.param("native", marks=needs_native)]

TINY = DeviceProfile(sm_count=1, max_threads_per_sm=256)  # T = 256: many steps per thread on tiny tensors
A4000 = DeviceProfile(sm_count=48, max_threads_per_sm=1536)
PROFILES = [TINY, DeviceProfile(3, 1024), A4000, A100, H100_SXM]
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
INTEGRALS = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]


def draw(shape, kind, dtype=torch.float32, *, seed=0, offset=0, profile=TINY, index=None, backend="auto", **params):
    """generate() into a fresh tensor; ``index`` lists per-dim global indices (None: whole tensor).
    backend "auto" is the compiled kernel where it builds; tests below prove it equals the torch path."""
    dim_indices = None if index is None else [torch.as_tensor(ix, dtype=torch.int64) for ix in index]
    local_shape = tuple(shape) if index is None else tuple(len(ix) for ix in index)
    out = torch.empty(local_shape, dtype=dtype)
    generate(out, kind, seed=seed, offset=offset, global_shape=tuple(shape), dim_indices=dim_indices,
             profile=profile, backend=backend, **params)
    return out


def words_of(seed: int, counter: int, thread: int):
    """The four Philox words of one call, from the KAT-tested core with Python ints."""
    m = philox.MASK32
    return philox.philox4x32_10(counter & m, counter >> 32, thread & m, thread >> 32, seed & m, seed >> 32)


# ---- launch geometry and offsets ---------------------------------------------------------------------


@pytest.mark.parametrize("profile", PROFILES)
def test_num_threads_formula(profile):
    max_blocks = profile.sm_count * (profile.max_threads_per_sm // 256)
    for n in (1, 255, 256, 257, 256 * max_blocks - 1, 256 * max_blocks, 256 * max_blocks + 1, 10**9):
        assert profile.num_threads(n) == 256 * min(max_blocks, -(-n // 256))
    assert profile.num_threads(0) == 0
    assert H100_SXM.num_threads(10**9) == 270_336 and A100.num_threads(10**9) == 221_184


@pytest.mark.parametrize("bad", [(0, 2048), (132, 128), (-1, 2048), (132.0, 2048)])
def test_profile_rejects_nonsense(bad):
    with pytest.raises(ValueError, match="DeviceProfile"):
        DeviceProfile(*bad)


UNROLL_CASES = [  # (kind, dtype, params, U)
    ("uniform", torch.float32, dict(low=0.0, high=1.0), 4),
    ("uniform", torch.bfloat16, dict(low=0.0, high=1.0), 4),
    ("uniform", torch.float64, dict(low=0.0, high=1.0), 2),
    ("normal", torch.float16, dict(mean=0.0, std=1.0), 4),
    ("normal", torch.float64, dict(mean=0.0, std=1.0), 2),
    ("bernoulli", torch.int64, dict(p=0.5), 4),
    ("bernoulli", torch.float64, dict(p=0.5), 2),
    ("random", torch.int64, dict(low=0, high=2**28 - 1), 4),
    ("random", torch.int32, dict(low=0, high=2**28), 2),
    ("random", torch.int32, {}, 4),
    ("random", torch.int64, {}, 2),
    ("random", torch.float64, {}, 2),
    ("random", torch.int64, dict(low=-(2**63), high=None), 2),
]


@pytest.mark.parametrize("kind, dtype, params, unroll", UNROLL_CASES)
@pytest.mark.parametrize("profile", [TINY, H100_SXM])
def test_offset_increment_formula(kind, dtype, params, unroll, profile):
    for n in (1, 5, 256, 257, 4096, 270_336 * 2 + 1, 10**8):
        threads = profile.num_threads(n)
        assert offset_increment(kind, dtype, n, profile, **params) == ((n - 1) // (threads * unroll) + 1) * 4
    assert offset_increment(kind, dtype, 0, profile, **params) == 0


def test_offset_increment_of_tensors_split_for_32bit_indexing():
    # float32: 1 + (n - 1) * 4 bytes must stay below 2**31, so 2**29 elements fit and 2**29 + 1 do not.
    n = 2**29
    incr = lambda m: ((m - 1) // (H100_SXM.num_threads(m) * 4) + 1) * 4  # noqa: E731
    assert offset_increment("uniform", torch.float32, n, H100_SXM, low=0.0, high=1.0) == incr(n)
    # split into 2**28 and 2**28 + 1, each its own launch, after the whole tensor's own increment
    expected = incr(n + 1) + incr(2**28) + incr(2**28 + 1)
    assert offset_increment("uniform", torch.float32, n + 1, H100_SXM, low=0.0, high=1.0) == expected
    # bool (1 byte) splits on the element count: 2**31 - 1 fits, 2**31 becomes two halves
    assert offset_increment("bernoulli", torch.bool, 2**31 - 1, TINY, p=0.5) == incr_tiny(2**31 - 1, 4)
    assert offset_increment("bernoulli", torch.bool, 2**31, TINY, p=0.5) == incr_tiny(2**31, 4) + 2 * incr_tiny(2**30, 4)


def incr_tiny(n, unroll):
    return ((n - 1) // (256 * unroll) + 1) * 4


def test_offset_increment_of_bernoulli_with_tensor_p_is_fixed():
    p = torch.full((3, 5), 0.5)
    assert offset_increment("bernoulli", torch.float32, 15, H100_SXM, p=p) == 12
    assert offset_increment("bernoulli", torch.float32, 10**9, H100_SXM, p=p) == 12
    assert offset_increment("bernoulli", torch.float32, 0, H100_SXM, p=p) == 0


# ---- the element -> counter mapping ------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("profile, n", [(TINY, 3000), (DeviceProfile(2, 512), 5000), (H100_SXM, 1000)])
def test_uniform_element_formula(profile, n, backend):
    seed, offset = 0x0123456789ABCDEF, 44
    values = draw((n,), "uniform", seed=seed, offset=offset, profile=profile, backend=backend, low=0.0, high=1.0)
    threads = profile.num_threads(n)
    for j in random.Random(n).sample(range(n), 40):
        step = j // threads
        word = words_of(seed, offset // 4 + step // 4, j % threads)[step % 4]
        expected = np.float32(np.float32(word) * np.float32(2.0**-32) + np.float32(2.0**-33))
        assert values[j].item() == (0.0 if expected == 1.0 else float(expected))


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_tensor_elements_use_their_launch(backend):
    # 2**29 + 1 float32 elements: two launches of 2**28 and 2**28 + 1 elements; only 6 are drawn here.
    n, seed, offset = 2**29 + 1, 7, 8
    first_increment = ((n - 1) // (H100_SXM.num_threads(n) * 4) + 1) * 4
    second_counter = (offset + first_increment + ((2**28 - 1) // (H100_SXM.num_threads(2**28) * 4) + 1) * 4) // 4
    picks = [0, 5, 2**28 - 1, 2**28, 2**28 + 270_336 * 3 + 11, n - 1]
    values = draw((n,), "uniform", seed=seed, offset=offset, profile=H100_SXM, index=[picks], backend=backend,
                  low=0.0, high=1.0)
    for j, value in zip(picks, values.tolist()):
        start, counter = (0, (offset + first_increment) // 4) if j < 2**28 else (2**28, second_counter)
        local = j - start
        step = local // 270_336
        word = words_of(seed, counter + step // 4, local % 270_336)[step % 4]
        assert value == float(np.float32(np.float32(word) * np.float32(2.0**-32) + np.float32(2.0**-33)))


def test_offset_shifts_the_stream_by_one_call():
    # With the same T, the value at step m under offset + 4 is the value at step m + U under offset.
    n = 256 * 4 * 3
    base = draw((n,), "uniform", offset=40, low=0.0, high=1.0)
    shifted = draw((n,), "uniform", offset=44, low=0.0, high=1.0)
    assert torch.equal(shifted[: n - 1024], base[1024:])
    assert not torch.equal(shifted, base)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bernoulli_with_tensor_p_uses_the_apply4_mapping(backend):
    seed, offset, shape = 99, 16, (7, 9)
    p = torch.rand(shape, generator=torch.Generator().manual_seed(0))
    got = draw(shape, "bernoulli", seed=seed, offset=offset, backend=backend, p=p)
    flat_p = p.reshape(-1).tolist()
    for j, value in enumerate(got.reshape(-1).tolist()):
        word = words_of(seed, offset // 4, j // 4)[j % 4]
        u = np.float32(np.float32(word) * np.float32(2.0**-32) + np.float32(2.0**-33))
        assert value == float(u <= np.float32(flat_p[j]))


# ---- values: transforms against CUDA and against their definitions -----------------------------------


# torch.randn / normal_ outputs printed by CUDA in public PyTorch issues (4 decimals). Box-Muller there uses
# the hardware __sincosf, so ours agree to the printed precision (5e-5) but not bit for bit.
GOLDEN_NORMALS = [
    # pytorch#143086: Generator('cuda').manual_seed(1); torch.randn(1, 9483264), first and last 3 values
    ((1, 9_483_264), 1, H100_SXM, dict(mean=0.0, std=1.0), [[0], [0, 1, 2, 9_483_261, 9_483_262, 9_483_263]],
     [[-0.2963, 2.6764, -0.1408, -0.6970, -0.7780, 0.3267]]),
    ((1, 9_483_264), 1, A100, dict(mean=0.0, std=1.0), [[0], [0, 1, 2, 9_483_261, 9_483_262, 9_483_263]],
     [[-0.2963, 2.6764, -0.1408, 0.1549, -0.6797, -0.1656]]),
    # pytorch#97097: torch.manual_seed(14); torch.cuda.FloatTensor(1000, 100).normal_(5, 5 ** .5) on an RTX A4000
    ((1000, 100), 14, A4000, dict(mean=5.0, std=5**0.5), [[0, 1, 2, 997, 998, 999], [0, 1, 2, 97, 98, 99]],
     [[2.8731, 5.2727, 2.9889, 1.6853, 9.6331, 6.6319], [3.9968, 3.8097, 5.7328, 4.4029, 3.9804, 7.4698],
      [6.5552, 4.0857, 4.2315, 2.7704, 3.5479, 3.3063], [8.6297, 2.3137, 6.2596, 7.9358, 4.4697, 2.7475],
      [7.0551, 7.8583, 3.9990, 4.1139, 8.9315, 4.2042], [2.7337, 2.2106, 7.7815, 8.2207, 6.5395, 4.2604]]),
    # pytorch#158398: randn([1, 64, 2048], generator=manual_seed(42)) on a GPU with T = 43,008 threads
    # (28 SMs x 1536, e.g. an RTX 3060: the only thread count that fits all 36 printed values)
    ((1, 64, 2048), 42, DeviceProfile(28, 1536), dict(mean=0.0, std=1.0),
     [[0], [0, 1, 2, 61, 62, 63], [0, 1, 2, 2045, 2046, 2047]],
     [[[0.1940, 2.1614, -0.1721, 1.4540, -2.7733, -0.8932], [-0.4574, 0.8063, 0.1580, 0.1124, 0.2769, -1.2535],
       [1.1346, -0.6329, -0.9147, -1.0001, -1.1552, -0.6955], [-0.4861, 0.3358, 1.0578, -0.7282, 0.5087, 0.1318],
       [0.7881, 0.8339, -1.1424, -0.6297, -1.1112, -0.4091], [-1.2356, -0.4083, -0.4695, -0.4841, 1.2850, -0.0282]]]),
]


@pytest.mark.parametrize("shape, seed, profile, params, index, printed", GOLDEN_NORMALS)
def test_normal_matches_values_printed_by_cuda(shape, seed, profile, params, index, printed):
    got = draw(shape, "normal", seed=seed, profile=profile, index=index, **params)
    assert torch.allclose(got, torch.tensor(printed), rtol=0, atol=6e-5), got


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_uniform_rounds_then_maps_to_back_to_low(dtype):
    # Same words as float32 (U = 4 for both), so the half / bfloat16 value is the float32 u rounded, with a
    # value that rounds up to `high` = 1 replaced by `low` = 0 (CUDA's (0, 1] -> [0, 1) flip).
    n = 2**16
    u = draw((n,), "uniform", torch.float32, profile=H100_SXM, low=0.0, high=1.0)
    got = draw((n,), "uniform", dtype, profile=H100_SXM, low=0.0, high=1.0)
    rounded = u.to(dtype)
    assert (rounded == 1).sum() > 0  # the test needs some values that round up to 1
    assert torch.equal(got, torch.where(rounded == 1, torch.zeros((), dtype=dtype), rounded))


def test_uniform_range_uses_fused_multiply_add_in_float32():
    n = 5000
    u = draw((n,), "uniform", torch.float32, low=0.0, high=1.0)
    got = draw((n,), "uniform", torch.float32, low=-3.0, high=7.5)
    exact = philox.fma_float(u, torch.tensor(10.5), torch.tensor(-3.0))
    assert torch.equal(got, torch.where(exact == 7.5, torch.tensor(-3.0), exact))
    assert float(got.min()) >= -3.0 and float(got.max()) < 7.5


def test_bernoulli_scalar_is_uniform_below_p():
    n = 4000
    for dtype, udtype in ((torch.float32, torch.float32), (torch.int8, torch.float32), (torch.float64, torch.float64)):
        u = draw((n,), "uniform", udtype, low=0.0, high=1.0, seed=5)
        u = torch.where(u == 0, 1.0, u)  # undo uniform's 1 -> 0 flip: bernoulli compares the raw u in (0, 1]
        got = draw((n,), "bernoulli", dtype, p=0.3, seed=5)
        assert torch.equal(got, (u < torch.tensor(0.3, dtype=udtype)).to(dtype))


@pytest.mark.parametrize("dtype, low, high", [
    (torch.int64, -5, 17), (torch.int8, -128, 128), (torch.uint8, 0, 256), (torch.bool, 0, 2),
    (torch.float16, -100, 2049), (torch.bfloat16, 0, 300), (torch.int32, 0, 2**28),
    (torch.int64, -(2**62), 2**62), (torch.float64, -(2**60), 2**61),
])
def test_random_from_to_stays_in_range_and_covers_it(dtype, low, high):
    got = draw((20000,), "random", dtype, low=low, high=high, seed=3).to(torch.float64)
    assert float(got.min()) >= low and float(got.max()) <= high - 1
    assert float(got.max() - got.min()) > 0.9 * (high - 1 - low)


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_32bit_formula(backend):
    n, seed = 3000, 11
    got = draw((n,), "random", torch.int64, low=-7, high=1000, seed=seed, backend=backend)
    for j in random.Random(0).sample(range(n), 30):
        step = j // 256
        word = words_of(seed, step // 4, j % 256)[step % 4]
        assert got[j].item() == word % 1007 - 7


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_64bit_formula(backend):
    n, seed, low, high = 2000, 12, -(2**40), 2**45
    got = draw((n,), "random", torch.int64, low=low, high=high, seed=seed, backend=backend)
    for j in random.Random(1).sample(range(n), 30):
        step = j // 256
        w = words_of(seed, step // 2, j % 256)
        bits = (w[2 * (step % 2)] << 32) | w[2 * (step % 2) + 1]  # the first word is the high half
        assert got[j].item() == bits % (high - low) + low


@pytest.mark.parametrize("dtype, modulus", [
    (torch.bool, 2), (torch.uint8, 256), (torch.int8, 128), (torch.int16, 2**15), (torch.int32, 2**31),
    (torch.int64, 2**63), (torch.float16, 2**11 + 1), (torch.bfloat16, 2**8 + 1), (torch.float32, 2**24 + 1),
    (torch.float64, 2**53 + 1),
])
def test_random_without_bounds_uses_the_dtype_range(dtype, modulus):
    n, seed = 600, 13
    got = draw((n,), "random", dtype, seed=seed)
    wide = dtype in (torch.int64, torch.float64)
    for j in range(0, n, 37):
        step = j // 256
        w = words_of(seed, step // (2 if wide else 4), j % 256)
        bits = ((w[2 * (step % 2)] << 32) | w[2 * (step % 2) + 1]) if wide else w[step % 4]
        assert got[j].item() == (bits % modulus if dtype != torch.bool else bool(bits & 1))


def test_random_full_64bit_range():
    got = draw((3000,), "random", torch.int64, low=-(2**63), high=None, seed=1)
    assert int(got.min()) < -(2**62) and int(got.max()) > 2**62
    as_float = draw((3000,), "random", torch.float32, low=-(2**63), high=None, seed=1)
    assert torch.equal(as_float, got.to(torch.float32))


def test_random_half_bounds_are_pulled_into_the_dtype():
    # random_(0, 65504) on float16: `to` moves to 65472 so that no value rounds up to 65504
    got = draw((50000,), "random", torch.float16, low=0, high=65504, seed=2)
    assert float(got.max()) <= 65472


def test_normal_statistics():
    # 2**18 standard normals: the sample mean has sd 2**-9 ~ 0.002 and the sample std ~ 0.0014;
    # the tolerances are about 5 standard errors.
    n = 2**18
    for dtype in (torch.float32, torch.float64):
        z = draw((n,), "normal", dtype, profile=H100_SXM, seed=21, mean=0.0, std=1.0).to(torch.float64)
        assert torch.isfinite(z).all()
        assert abs(z.mean().item()) < 0.01 and abs(z.std().item() - 1) < 0.008
        assert abs(((z > 1.96).double().mean().item()) - 0.025) < 0.002  # the tails are right too
    scaled = draw((4096,), "normal", torch.float64, seed=21, mean=3.0, std=0.5)
    base = draw((4096,), "normal", torch.float64, seed=21, mean=0.0, std=1.0)
    assert torch.equal(scaled, philox.fma_double(base, torch.tensor(0.5, dtype=torch.float64), torch.tensor(3.0, dtype=torch.float64)))


# ---- blocks: any subset equals the same subset of the whole tensor -----------------------------------


ALL_KINDS = [
    ("uniform", torch.float32, dict(low=-1.0, high=2.0)), ("uniform", torch.bfloat16, dict(low=0.0, high=1.0)),
    ("uniform", torch.float64, dict(low=0.0, high=1.0)), ("normal", torch.float16, dict(mean=1.0, std=2.0)),
    ("normal", torch.float64, dict(mean=0.0, std=1.0)), ("bernoulli", torch.bool, dict(p=0.25)),
    ("bernoulli", torch.float64, dict(p=0.75)), ("random", torch.int32, dict(low=-50, high=50)),
    ("random", torch.int64, dict(low=0, high=2**40)), ("random", torch.float32, {}),
]


def random_block(rng: random.Random, shape):
    """Per-dim global indices: full, a contiguous range, a permuted subset with repeats, or empty."""
    index = []
    for size in shape:
        style = rng.random()
        if style < 0.3:
            ix = list(range(size))
        elif style < 0.6:
            a = rng.randrange(size)
            ix = list(range(a, rng.randrange(a, size) + 1))
        elif style < 0.95:
            ix = [rng.randrange(size) for _ in range(rng.randint(1, size))]
        else:
            ix = []
        index.append(ix)
    return index


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind, dtype, params", ALL_KINDS)
def test_block_equals_slice_of_whole(kind, dtype, params, backend):
    rng = random.Random(len(kind) * 100 + FLOATS.index(dtype) if dtype in FLOATS else 7)
    for _ in range(8):
        shape = [rng.randint(1, 9) for _ in range(rng.randint(1, 5))]
        seed = rng.getrandbits(64)
        whole = draw(shape, kind, dtype, seed=seed, offset=8, backend=backend, **params)
        index = random_block(rng, shape)
        block = draw(shape, kind, dtype, seed=seed, offset=8, index=index, backend=backend, **params)
        assert block.shape == tuple(len(ix) for ix in index)
        if block.numel():
            assert torch.equal(block, whole[np.ix_(*[np.array(ix) for ix in index])]), (shape, index)


# ---- the compiled kernel against the PyTorch path ------------------------------------------------------

CROSS_KINDS = ALL_KINDS + [
    ("uniform", torch.float16, dict(low=-1000.0, high=1000.0)), ("uniform", torch.float64, dict(low=-2.5, high=1e6)),
    ("normal", torch.float32, dict(mean=0.0, std=1.0)), ("normal", torch.bfloat16, dict(mean=-3.0, std=0.25)),
    ("normal", torch.float64, dict(mean=2.0, std=3.0)), ("bernoulli", torch.int32, dict(p=0.5)),
    ("bernoulli", torch.float16, dict(p=1.0)), ("random", torch.int8, {}), ("random", torch.bool, {}),
    ("random", torch.float64, {}), ("random", torch.bfloat16, dict(low=-(2**63), high=None)),
    ("random", torch.int64, dict(low=-(2**63), high=2**63 - 1)), ("random", torch.uint8, dict(low=3, high=None)),
]


@st.composite
def blocks(draw_, max_dims=4):
    """A global shape (up to ~4000 elements, so T = 256 or 512 gives several steps and call blocks) and per-dim
    global indices of a block: whole dims, step-1 ranges, reversed, strided, random with repeats, empty."""
    shape = draw_(st.lists(st.integers(1, 40), min_size=1, max_size=max_dims).filter(lambda s: math.prod(s) <= 4000))
    index = []
    for size in shape:
        style = draw_(st.sampled_from(["all", "all", "range", "reversed", "strided", "random", "empty"]))
        if style == "all":
            ix = list(range(size))
        elif style == "range":
            a = draw_(st.integers(0, size - 1))
            ix = list(range(a, draw_(st.integers(a + 1, size))))
        elif style == "reversed":
            ix = list(range(size))[::-1]
        elif style == "strided":
            ix = list(range(draw_(st.integers(0, size - 1)), size, draw_(st.integers(2, 5))))
        elif style == "random":
            ix = draw_(st.lists(st.integers(0, size - 1), min_size=1, max_size=size))
        else:
            ix = []
        index.append(ix)
    return shape, index


@needs_native
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=st.sampled_from(CROSS_KINDS), block=blocks(), seed=st.integers(0, 2**64 - 1), offset=st.integers(0, 2**40),
    profile=st.sampled_from([TINY, DeviceProfile(2, 512), DeviceProfile(3, 768), H100_SXM]),
    whole=st.booleans(),
)
def test_compiled_kernel_equals_torch_path(case, block, seed, offset, profile, whole):
    kind, dtype, params = case
    shape, index = block
    index = None if whole else index
    args = dict(seed=seed, offset=4 * (offset // 4), profile=profile, index=index, **params)
    assert torch.equal(draw(shape, kind, dtype, backend="native", **args), draw(shape, kind, dtype, backend="torch", **args))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_compiled_bernoulli_with_tensor_p_equals_torch_path(dtype):
    shape, index = (30, 50), [list(range(3, 29)), list(range(49, -1, -3))]
    p = torch.rand((26, 17), generator=torch.Generator().manual_seed(1))
    args = dict(seed=5, offset=20, index=index, p=p)
    assert torch.equal(draw(shape, "bernoulli", dtype, backend="native", **args),
                       draw(shape, "bernoulli", dtype, backend="torch", **args))


@needs_native
def test_compiled_kernel_uses_whole_calls_on_long_runs():
    # A contiguous block longer than T * U goes call by call (each Philox call feeds U elements) in the
    # C kernel; every layout must still give the same bits as the torch path: whole rows, a column
    # block, both on a tensor split into several launches (bool: 1 byte, so 2**31 elements split).
    shape = (4, 2**29 + 3)
    for index in ([[1], list(range(0, 5000))], [[3], list(range(2**29 - 2000, 2**29 + 3))],
                  [[0, 2], list(range(2**28 - 3000, 2**28 + 3000))]):
        args = dict(seed=3, offset=4, profile=DeviceProfile(1, 512), index=index, p=0.5)
        assert torch.equal(draw(shape, "bernoulli", torch.bool, backend="native", **args),
                           draw(shape, "bernoulli", torch.bool, backend="torch", **args))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_compiled_normal_of_column_blocks_equals_torch_path(dtype):
    # A column block (Shard(1)) is one run per row: consecutive threads at one step, one Philox call and one
    # half of a Box-Muller pair per element (the C kernel's one-word path). T = 1024 here; widths around the
    # kernel's lane groups (8, 32, 64 lanes) and a run crossing a step boundary (column 1000 + 50 > 1024).
    shape = (3, 3000)
    for first, width in [(0, 1), (5, 7), (64, 31), (100, 33), (200, 64), (300, 65), (1000, 50), (1500, 1400)]:
        args = dict(seed=11, offset=8, profile=DeviceProfile(2, 512), index=[[0, 2], list(range(first, first + width))],
                    mean=0.5, std=2.0)
        assert torch.equal(draw(shape, "normal", dtype, backend="native", **args),
                           draw(shape, "normal", dtype, backend="torch", **args)), (first, width)


def test_without_a_compiler_the_torch_path_is_used(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(_native, "_kernel", None)
    monkeypatch.setattr(_native, "_failure", None)
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        assert _native.load() is None
    with pytest.raises(RuntimeError, match="unavailable"):
        draw((5,), "uniform", backend="native", low=0.0, high=1.0)
    auto = draw((300,), "uniform", backend="auto", low=0.0, high=1.0)  # falls back, same values
    assert torch.equal(auto, draw((300,), "uniform", backend="torch", low=0.0, high=1.0))


# ---- input validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("call, message", [
    (lambda: draw((4,), "gaussian"), "unknown kind"),
    (lambda: draw((4,), "uniform", low=0.0), "missing"),
    (lambda: draw((4,), "uniform", low=0.0, high=1.0, mean=0.0), "unexpected"),
    (lambda: draw((4,), "uniform", torch.int32, low=0.0, high=1.0), "does not support dtype"),
    (lambda: draw((4,), "uniform", low=2.0, high=1.0), "low <= high"),
    (lambda: draw((4,), "uniform", low=0.0, high=float("inf")), "finite"),
    (lambda: draw((4,), "normal", mean=0.0, std=-1.0), "std >= 0"),
    (lambda: draw((4,), "bernoulli", p=1.5), r"p in \[0, 1\]"),
    (lambda: draw((4,), "bernoulli", p=torch.full((4,), 2.0)), r"\[0, 1\]"),
    (lambda: draw((4,), "bernoulli", p=torch.full((5,), 0.5)), "shape"),
    (lambda: draw((4,), "random", torch.int8, low=0, high=300), "out of bounds"),
    (lambda: draw((4,), "random", low=5, high=5), "low < high"),
    (lambda: draw((4,), "uniform", offset=6, low=0.0, high=1.0), "multiple of 4"),
    (lambda: draw((4,), "uniform", seed=-1, low=0.0, high=1.0), "seed"),
    (lambda: draw((4,), "uniform", index=[[0, 4]], low=0.0, high=1.0), "outside"),
    (lambda: draw((4, 2), "uniform", index=[[0, 1]], low=0.0, high=1.0), "one index tensor per global dim"),
    (lambda: draw((4,), "uniform", backend="cuda", low=0.0, high=1.0), "backend"),
])
def test_bad_input_is_named(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()


def test_out_shape_must_match_the_block():
    out = torch.empty(3)
    with pytest.raises(ValueError, match="dim_indices select"):
        generate(out, "uniform", seed=0, offset=0, global_shape=(8,), dim_indices=[torch.arange(2)],
                 profile=TINY, low=0.0, high=1.0)
