"""vescale.random's Triton kernel (the CUDA path) against the compiled C kernel, bit for bit, on the CPU.

No GPU here: the kernel runs in Triton's interpreter, which ``kernel.generate(..., backend="triton")``
selects for a CPU tensor (``_triton.load(interpret=True)``: the kernel module decorated with
``triton.knobs.runtime.interpret`` on, Triton's API for TRITON_INTERPRET=1). The interpreter executes the
kernel's own operations (the same uint32 Philox, the same IEEE float64/float32 steps, the same stores)
with numpy, so these tests check the kernel's logic and arithmetic order; what the GPU's compiler does
with them is argued in docs/random.md and checked natively only by test_native_cuda.py (GPU only).

Sizes are small: the interpreter runs one program instance (512 elements) at a time in numpy.
"""

import re

import pytest
import torch
import triton  # a test dependency (pyproject's `test` extra pins it)
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_kernel import CROSS_KINDS, TINY, blocks, draw
from test_philox import KAT_PHILOX4X32_10
from triton import knobs
from triton.runtime.interpreter import InterpretedFunction

from vescale.random import _native, _triton, philox
from vescale.random.kernel import A100, H100_SXM, DeviceProfile, resolve_draw

KERNELS = _triton.load(interpret=True)
# The reference: the compiled C kernel, else (only on a platform without a C compiler) the pure-PyTorch
# path (same bits, tested). With a compiler, a kernel that fails to build fails these tests
# (backend="native" loads it with required=True) instead of quietly changing the reference.
REFERENCE = "native" if _native.has_compiler() else "torch"


def test_cpu_tensors_run_the_interpreted_kernel_and_leave_triton_as_it_was():
    assert isinstance(KERNELS.fill_kernel, InterpretedFunction)
    assert isinstance(KERNELS.philox4x32_10, InterpretedFunction)
    assert knobs.runtime.interpret is False  # loading the interpreted module does not switch the process
    assert not isinstance(_triton.load(interpret=False).fill_kernel, InterpretedFunction)


# ---- Philox: Random123's known answers, and the C kernel's words ----


def _philox_kernel_fn(c0_ptr, c1_ptr, c2_ptr, c3_ptr, out_ptr, k0, k1, N: tl.constexpr):
    i = tl.arange(0, N)
    words = KERNELS.philox4x32_10(
        tl.load(c0_ptr + i), tl.load(c1_ptr + i), tl.load(c2_ptr + i), tl.load(c3_ptr + i),
        k0.to(tl.uint32), k1.to(tl.uint32),
    )
    for w in tl.static_range(4):
        tl.store(out_ptr + 4 * i + w, words[w])


with knobs.runtime.scope():
    knobs.runtime.interpret = True
    _philox_kernel = triton.jit(_philox_kernel_fn)


def triton_philox(counters, k0: int, k1: int) -> torch.Tensor:
    """The kernel's Philox4x32-10 of int64 tensors of counter words: an (n, 4) int64 tensor of words."""
    n = counters[0].numel()
    words = [c.to(torch.int64).to(torch.int32).view(torch.uint32).contiguous() for c in counters]
    out = torch.zeros((n, 4), dtype=torch.uint32)
    _philox_kernel[(1,)](*words, out, k0, k1, N=n)
    return out.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def test_philox_known_answers():
    rows = KAT_PHILOX4X32_10 * 2 + KAT_PHILOX4X32_10[:2]  # 8 lanes (a power of two), every vector in some
    counters = [torch.tensor([counter[i] for counter, _, _ in rows]) for i in range(4)]
    for counter, key, expected in KAT_PHILOX4X32_10:
        words = triton_philox(counters, *key)
        for row, (row_counter, _, _) in enumerate(rows):
            if row_counter == counter:
                assert words[row].tolist() == list(expected)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**64 - 1), data=st.data())
def test_philox_equals_the_c_kernel(seed, data):
    counters = [torch.tensor(data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=16, max_size=16))) for _ in range(4)]
    k0, k1 = seed & 0xFFFFFFFF, seed >> 32
    expected = torch.stack(philox.philox4x32_10(*counters, k0, k1), dim=1)
    if _native.has_compiler():
        assert torch.equal(_native.load(required=True).philox(*counters, k0, k1), expected)
    assert torch.equal(triton_philox(counters, k0, k1), expected)


# ---- the number transforms one by one, against philox.py (the reference the C kernel equals) ----


def _transform_kernel_fn(x_ptr, y_ptr, z_ptr, out_ptr, FN: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    y = tl.load(y_ptr + i)
    z = tl.load(z_ptr + i)
    if FN == 0:
        result = KERNELS.fma_float(x, y, z)
    elif FN == 1:
        result = KERNELS.fma_double(x, y, z)
    elif FN == 2:
        result = KERNELS.det_log(x)
    elif FN == 3:
        result = KERNELS.det_sqrt(x)
    elif FN == 4:
        result = KERNELS.det_sin_or_cos(x, (i & 1).to(tl.int64))
    else:
        result = KERNELS.det_sinpi_or_cospi(x, (i & 1).to(tl.int64))
    tl.store(out_ptr + i, result)


with knobs.runtime.scope():
    knobs.runtime.interpret = True
    _transform_kernel = triton.jit(_transform_kernel_fn)


def triton_transform(fn: int, x, y=None, z=None):
    out = torch.empty_like(x)
    _transform_kernel[(1,)](x, x if y is None else y, x if z is None else z, out, FN=fn, N=x.numel())
    return out


def _f32(*values):
    return torch.tensor(values, dtype=torch.float32)


def _f64(*values):
    return torch.tensor(values, dtype=torch.float64)


def test_fma_emulation_rounds_once_where_a_product_then_a_sum_would_round_twice():
    # (1 + 2**-12)**2 + 2**-60 lies just above a float32 tie: one rounding gives 1 + 2**-11 + 2**-23; rounding
    # the float64 sum first lands on the tie and then on 1 + 2**-11. The float64 case has its tie at 2**-53.
    a, b, c = _f32(1 + 2**-12, 1.0, -3.5, 0.75), _f32(1 + 2**-12, 1.0, 2.0**-30, 3.0), _f32(2**-60, 0.0, 7.0, -1.0)
    got = triton_transform(0, a, b, c)
    assert got[0].item() == 1 + 2**-11 + 2**-23
    assert torch.equal(got, philox.fma_float(a, b, c))
    a, b, c = _f64(1 + 2**-26, 3.0, -1e30, 0.1), _f64(1 + 2**-27, 1 / 3, 1e-30, 0.2), _f64(2**-100, 1.0, 0.5, -0.02)
    got = triton_transform(1, a, b, c)
    assert got[0].item() == 1 + 2**-26 + 2**-27 + 2**-52
    assert torch.equal(got, philox.fma_double(a, b, c))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # det_sqrt(0) computes 0 * inf, then discards it
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_transforms_equal_philox_py(seed):
    gen = torch.Generator().manual_seed(seed)
    n = 64
    a, b, c = (torch.randn(n, generator=gen) * 10 ** torch.randint(-3, 4, (n,), generator=gen) for _ in range(3))
    assert torch.equal(triton_transform(0, a, b, c), philox.fma_float(a, b, c))
    a, b, c = (x.double() * (1 + torch.rand(n, generator=gen, dtype=torch.float64)) for x in (a, b, c))
    assert torch.equal(triton_transform(1, a, b, c), philox.fma_double(a, b, c))
    # log and sqrt over the inputs Box-Muller gives them: u in (0, 1], -2 log u in [0, 46]
    u = torch.rand(n, generator=gen, dtype=torch.float64) ** 8 + 2.0**-54
    assert torch.equal(triton_transform(2, u), philox.det_log(u))
    r = torch.cat([torch.zeros(1, dtype=torch.float64), -2 * philox.det_log(u)[1:]])
    assert torch.equal(triton_transform(3, r), philox.det_sqrt(r))
    v = torch.rand(n, generator=gen, dtype=torch.float64) * 6.2832
    want_cos = torch.arange(n) % 2 == 1
    assert torch.equal(triton_transform(4, v), philox.det_sin_or_cos(v, want_cos))
    assert torch.equal(triton_transform(5, v / 3.1416), philox.det_sinpi_or_cospi(v / 3.1416, want_cos))


# ---- the whole kernel: every op, dtype and block against the C kernel ----


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=st.sampled_from(CROSS_KINDS), block=blocks(max_dims=3), seed=st.integers(0, 2**64 - 1),
    offset=st.integers(0, 2**40), profile=st.sampled_from([TINY, DeviceProfile(2, 512), DeviceProfile(3, 768), A100]),
    whole=st.booleans(),
)
def test_triton_kernel_equals_c_kernel(case, block, seed, offset, profile, whole):
    kind, dtype, params = case
    shape, index = block
    args = dict(seed=seed, offset=4 * (offset // 4), profile=profile, index=None if whole else index, **params)
    assert torch.equal(draw(shape, kind, dtype, backend="triton", **args), draw(shape, kind, dtype, backend=REFERENCE, **args))


# every dtype with every op that takes it, on one small block with several steps per thread
EVERY_DTYPE = [
    *[("uniform", d, dict(low=-3.0, high=5.0)) for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)],
    *[("normal", d, dict(mean=0.0, std=1.0)) for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)],
    *[("normal", d, dict(mean=-0.5, std=0.02)) for d in (torch.float32, torch.float64)],
    *[("bernoulli", d, dict(p=0.4)) for d in
      (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.bool, torch.uint8, torch.int8,
       torch.int16, torch.int32, torch.int64)],
    *[("random", d, {}) for d in
      (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.bool, torch.uint8, torch.int8,
       torch.int16, torch.int32, torch.int64)],
    ("random", torch.int64, dict(low=-7, high=2**40)), ("random", torch.int32, dict(low=-(2**31), high=2**31 - 1)),
    ("random", torch.float64, dict(low=-(2**63), high=None)), ("random", torch.int16, dict(low=-100, high=None)),
    # rounding edges: float16 subnormals and overflow to inf, bfloat16 near float32's limit, float32 subnormals
    ("normal", torch.float16, dict(mean=0.0, std=1e-6)), ("normal", torch.float16, dict(mean=0.0, std=3e4)),
    ("normal", torch.bfloat16, dict(mean=0.0, std=2e38)), ("normal", torch.float32, dict(mean=0.0, std=1e-40)),
    ("uniform", torch.float16, dict(low=-1e-7, high=1e-7)), ("uniform", torch.bfloat16, dict(low=-1.6e38, high=1.6e38)),
]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # numpy, rounding to inf on purpose
@pytest.mark.parametrize("kind, dtype, params", EVERY_DTYPE)
def test_every_dtype_equals_c_kernel(kind, dtype, params):
    shape, index = (9, 130), [[8, 0, 3, 3], list(range(2, 130, 3))]
    for block in (None, index):
        args = dict(seed=2**63 + 12345, offset=40, profile=TINY, index=block, **params)
        triton_values = draw(shape, kind, dtype, backend="triton", **args)
        assert torch.equal(triton_values, draw(shape, kind, dtype, backend=REFERENCE, **args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool, torch.bfloat16])
def test_bernoulli_with_tensor_p_equals_c_kernel(dtype):
    shape, index = (30, 50), [list(range(3, 29)), list(range(49, -1, -3))]
    p = torch.rand((26, 17), generator=torch.Generator().manual_seed(1))
    p[0, :5] = torch.tensor([0.0, 1.0, 0.5, 2.0**-33, 1.0 - 2.0**-24])  # u <= p at the edges
    args = dict(seed=5, offset=20, index=index, p=p)
    assert torch.equal(draw(shape, "bernoulli", dtype, backend="triton", **args),
                       draw(shape, "bernoulli", dtype, backend=REFERENCE, **args))


def test_uniform_values_rounding_to_high_become_low():
    # [1, 1 + 2**-10) in float16: most float32 uniforms round to the upper bound, which must become `low`
    args = dict(seed=3, offset=0, profile=TINY, low=1.0, high=1.0009765625)
    values = draw((700,), "uniform", torch.float16, backend="triton", **args)
    assert torch.equal(values, draw((700,), "uniform", torch.float16, backend=REFERENCE, **args))
    assert (values == 1.0).any() and not (values == 1.0009765625).any()


@pytest.mark.parametrize("kind, dtype, params", [
    ("uniform", torch.float32, dict(low=0.0, high=1.0)), ("normal", torch.float64, dict(mean=1.0, std=2.0)),
    ("bernoulli", torch.bool, dict(p=0.5)), ("random", torch.int64, dict(low=0, high=2**40)),
])
def test_blocks_of_tensors_split_for_32bit_indexing(kind, dtype, params):
    """Tensors over 2**31 bytes are several CUDA launches (TensorIterator's 32-bit split): elements next to
    every split point of a huge global tensor, drawn without building it."""
    numel = 2**31 + 6 if dtype == torch.bool else 2**29 + 6  # bool: 2 launches; 8-byte dtypes: 4; float32: 2
    quarter = numel // 4
    picks = sorted({j for point in (0, quarter, 2 * quarter, 3 * quarter, numel - 3) for j in range(point - 3, point + 3)
                    if 0 <= j < numel})
    args = dict(seed=99, offset=4, profile=H100_SXM, index=[picks], **params)
    assert torch.equal(draw((numel,), kind, dtype, backend="triton", **args),
                       draw((numel,), kind, dtype, backend=REFERENCE, **args))


# ---- what the GPU will execute: the PTX of every kernel variant, compiled here for an H100 ----

# Every floating-point instruction must be one whose result IEEE 754 fixes: +, -, *, / with an explicit
# round-to-nearest (.rn: ptxas never contracts or reorders those), exact moves, comparisons and selects,
# correctly rounded conversions, exact widening, and truncation (applied to integral values only).
ALLOWED_FLOAT_OPS = re.compile(
    r"(add|sub|mul)\.rn\.f(32|64)|div\.rn\.f64|(neg|abs)\.f(32|64)|(setp\.[a-z]+|selp|mov|ld\.[a-z.]+|st\.[a-z.]+)"
    r"\.(f32|f64|b32|b64)|cvt\.rn\.f(32|64)\.[suf](32|64)|cvt\.f64\.f32|cvt\.rzi\.s64\.f64"
)
PTX_VARIANTS = [
    ("uniform", torch.float32, dict(low=-3.0, high=5.0)), ("uniform", torch.bfloat16, dict(low=0.0, high=1.0)),
    ("uniform", torch.float64, dict(low=-3.0, high=5.0)), ("normal", torch.float16, dict(mean=1.0, std=2.0)),
    ("normal", torch.float64, dict(mean=1.0, std=2.0)), ("bernoulli", torch.bool, dict(p=0.3)),
    ("bernoulli", torch.float64, dict(p=torch.ones(1))), ("random", torch.float32, dict(low=0, high=2**40)),
]


def float_instructions(ptx: str) -> list[str]:
    instructions = re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9]*(?:\.[a-z0-9]+)*)", ptx, re.M)
    return [op for op in instructions if re.search(r"\.(b?f16|f32|f64)\b", op) or op.startswith("fma")]


@pytest.mark.parametrize("kind, dtype, params", PTX_VARIANTS)
def test_gpu_code_uses_only_correctly_rounded_float_operations(kind, dtype, params):
    ptx = _triton.compile_ptx(resolve_draw(kind, dtype, params), dtype, nlaunch=2)
    found = float_instructions(ptx)
    assert found, "no float instruction found: the PTX parser is broken"
    assert [op for op in found if not ALLOWED_FLOAT_OPS.fullmatch(op)] == []


def test_the_ptx_check_sees_contraction_when_fusion_is_on(monkeypatch):
    """The check above can fail: with Triton's default FP fusion the same kernel has FMAs."""
    monkeypatch.setattr(_triton, "COMPILE_OPTIONS", {"enable_fp_fusion": True})
    found = float_instructions(_triton.compile_ptx(resolve_draw("normal", torch.float64, dict(mean=1.0, std=2.0)),
                                                   torch.float64))
    assert any(op.startswith("fma") for op in found)
