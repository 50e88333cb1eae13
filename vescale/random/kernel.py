"""The counter-based random kernel of vescale.random: any block of a global random tensor, drawn locally.

A random op over a global tensor of N elements is modelled as PyTorch's CUDA kernels run it
(aten/src/ATen/native/cuda/DistributionTemplates.h, ``distribution_nullary_kernel``): a grid-stride
loop over a virtual GPU of T threads (block 256, grid = min(SMs * (max threads per SM / 256),
ceil(N / 256)), T = 256 * grid). Element j (C-order flat index in the global tensor) is drawn by
thread t = j % T at step m = j // T; the thread's Philox4x32-10 stream is keyed by the seed and starts
at counter (lo64 = offset / 4, hi64 = t) (curand_init(seed, t, offset)), so step m reads call
k = m // U of that stream and uses its word ii = m % U (U = 4 for 32-bit draws; U = 2 when a value
needs 64 bits: float64 uniform / normal / bernoulli, random with a range >= 2**28, random_() on
int64 / float64). Each value depends only on (seed, offset, j, N, dtype, op), so every rank computes
its own block with O(local elements) work and all ranks together hold what one device would.

Two CUDA details beyond the grid-stride loop are modelled as well:
- A tensor too large for 32-bit indexing (more than 2**31 - 1 elements, or 1 + (N - 1) * itemsize >
  2**31 - 1 bytes) is split by TensorIterator::with_32bit_indexing into halves, recursively, first
  half first; every piece is its own launch with its own T and offset (taken after the whole tensor's
  increment, which the outer call reserves before splitting).
- bernoulli with a tensor of probabilities uses a different kernel (bernoulli_tensor_cuda_kernel
  through CUDA_tensor_apply2): element j is word j % 4 of call (offset / 4, thread j // 4), kept
  when u <= p, and the offset always advances by 12 (10 rounded up to a multiple of 4).

The generator offset advances by ``offset_increment`` after each op, exactly as PyTorch's CUDA
generator does, so a sequence of ops consumes counters identically on one device and on many ranks.

Bit equality with CUDA (for the GPU the profile describes): uniform, bernoulli and random values are
integer arithmetic plus correctly rounded float operations and match bit for bit, assuming nvcc
contracts `rand * range + from` into a fused multiply-add (its default), which we emulate exactly.
Normal values cannot match: CUDA uses the approximate hardware __sincosf (float) and its own
log / sincospi (double); ours are deterministic float64 functions (see ``philox``), equal in C and in
PyTorch; they agree with normals printed by CUDA in public PyTorch issues to the 4 printed decimals (tests).

Three implementations give identical bits: a compiled C kernel (``_native``, the CPU path, used when it
builds), the pure-PyTorch path here (the reference, always available; ``backend="torch"`` forces it) and a
Triton kernel (``_triton``, the CUDA path: CUDA tensors are drawn on their device; on CPU tensors it runs in
Triton's interpreter, which is how the CPU-only test suite checks it). All three take the same description
of a draw: the resolved ``Draw``, the seed, the ``Launch``es and the block's global indices.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from vescale.random import philox

__all__ = ["DeviceProfile", "H100_SXM", "A100", "DEFAULT_PROFILE", "KINDS", "offset_increment", "generate"]

BLOCK_SIZE = 256  # threads per block of PyTorch's distribution kernels
INT32_MAX = 2**31 - 1
BERNOULLI_TENSOR_INCREMENT = 12  # bernoulli_tensor_cuda_kernel asks for 10; the generator rounds up to 4
KINDS = ("uniform", "normal", "bernoulli", "random")


@dataclass(frozen=True)
class DeviceProfile:
    """The two GPU properties that fix PyTorch's launch geometry for random ops."""

    sm_count: int  # cudaDeviceProp.multiProcessorCount
    max_threads_per_sm: int  # cudaDeviceProp.maxThreadsPerMultiProcessor

    def __post_init__(self):
        for name in ("sm_count", "max_threads_per_sm"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DeviceProfile.{name} must be a positive int, got {value!r}")
        if self.max_threads_per_sm < BLOCK_SIZE:
            raise ValueError(
                f"DeviceProfile.max_threads_per_sm must be >= {BLOCK_SIZE} (one block), got {self.max_threads_per_sm}"
            )

    def num_threads(self, numel: int) -> int:
        """T, the number of threads PyTorch launches for a random op over ``numel`` elements."""
        if numel <= 0:
            return 0
        max_blocks = self.sm_count * (self.max_threads_per_sm // BLOCK_SIZE)
        return BLOCK_SIZE * min(max_blocks, -(-numel // BLOCK_SIZE))


H100_SXM = DeviceProfile(sm_count=132, max_threads_per_sm=2048)
A100 = DeviceProfile(sm_count=108, max_threads_per_sm=2048)
# Used when no CUDA device says otherwise: values then match an H100 SXM (for tensors of at most
# 256 * 132 * 8 = 270,336 elements, every GPU with at least as many threads gives the same values).
DEFAULT_PROFILE = H100_SXM

# ---- what an op draws: resolved once from (kind, dtype, params), shared by both implementations ----

OP_UNIFORM, OP_NORMAL, OP_BERNOULLI, OP_RANDOM, OP_BERNOULLI_TENSOR = range(5)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTEGRAL_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Draw:
    """One op's draw, in the form the kernels consume (values already rounded as CUDA rounds them)."""

    op: int
    wide: bool  # float64 accumulation or 64-bit integer words
    unroll: int  # U: values per Philox call per thread
    a: float = 0.0  # uniform: from; normal: mean; bernoulli: p (all in the accumulate type)
    b: float = 0.0  # uniform: range = to - from; normal: std
    c: float = 0.0  # uniform: to (its dtype value): a value equal to it becomes `from`
    modulus: int = 0  # random: value = (bits % modulus) + base; 0 means 2**64 (bits as they are)
    base: int = 0


def _check_dtype(kind: str, dtype: torch.dtype, allowed) -> None:
    if dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise ValueError(f"vescale.random kernel: {kind} does not support dtype {dtype}; use one of {names}")


def _as_float(name: str, value) -> float:
    if isinstance(value, torch.Tensor):
        raise TypeError(f"vescale.random kernel: {name} must be a Python number, got a tensor")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"vescale.random kernel: {name} must be finite, got {value}")
    return value


def _to_dtype_value(value: float, dtype: torch.dtype) -> float:
    """``static_cast<scalar_t>(double)`` as CUDA code does it: through float32 for every float type
    narrower than float64 (c10::Half and c10::BFloat16 are built from a float), round to nearest even."""
    if dtype == torch.float64:
        return value
    return torch.tensor(value, dtype=torch.float64).to(torch.float32).to(dtype).item()


def _float32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float64).to(torch.float32).item()


def _uniform_draw(dtype, low, high) -> Draw:
    _check_dtype("uniform", dtype, FLOAT_DTYPES)
    low, high = _as_float("uniform low", low), _as_float("uniform high", high)
    if low > high:
        raise ValueError(f"vescale.random kernel: uniform expects low <= high, got low={low} > high={high}")
    if high - low > torch.finfo(dtype).max:
        raise ValueError(f"vescale.random kernel: uniform expects high - low <= {torch.finfo(dtype).max} for {dtype}")
    if dtype == torch.float64:
        return Draw(OP_UNIFORM, True, 2, a=low, b=high - low, c=high)
    # uniform_kernel: from/to are scalar_t; range = opmath(to - from), the subtraction done in scalar_t
    # (c10::Half - c10::Half rounds its float result back to Half).
    frm, to = _to_dtype_value(low, dtype), _to_dtype_value(high, dtype)
    span = torch.tensor(to, dtype=torch.float32) - torch.tensor(frm, dtype=torch.float32)
    span = span.to(dtype).to(torch.float32).item()
    return Draw(OP_UNIFORM, False, 4, a=frm, b=span, c=to)


def _normal_draw(dtype, mean, std) -> Draw:
    _check_dtype("normal", dtype, FLOAT_DTYPES)
    mean, std = _as_float("normal mean", mean), _as_float("normal std", std)
    if std < 0:
        raise ValueError(f"vescale.random kernel: normal expects std >= 0.0, got std={std}")
    if dtype == torch.float64:
        return Draw(OP_NORMAL, True, 2, a=mean, b=std)
    return Draw(OP_NORMAL, False, 4, a=_float32(mean), b=_float32(std))


def _bernoulli_draw(dtype, p) -> Draw:
    _check_dtype("bernoulli", dtype, FLOAT_DTYPES + INTEGRAL_DTYPES)
    if isinstance(p, torch.Tensor):
        return Draw(OP_BERNOULLI_TENSOR, dtype == torch.float64, 4)
    p = _as_float("bernoulli p", p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"vescale.random kernel: bernoulli expects p in [0, 1], got p={p}")
    if dtype == torch.float64:
        return Draw(OP_BERNOULLI, True, 2, a=p)
    return Draw(OP_BERNOULLI, False, 4, a=_float32(p))


def _digits(dtype: torch.dtype) -> int:
    """std::numeric_limits<scalar_t>::digits for a float type (mantissa bits including the implicit one)."""
    return {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}[dtype]


def _int_through_dtype(value: int, dtype: torch.dtype) -> float:
    """static_cast<int64_t>(static_cast<scalar_t>(value)) before the truncation (may be inf)."""
    as_float = torch.tensor(value, dtype=torch.int64).to(torch.float32 if dtype != torch.float64 else torch.float64)
    return as_float.to(dtype).to(torch.float64).item()


def _update_from(low: int, dtype) -> int:
    # DistributionTemplates.h update_from: move `from` right until casting to dtype keeps it >= from.
    from_plus_1 = _int_through_dtype(low + 1, dtype)
    if math.isfinite(from_plus_1) and int(from_plus_1) < low:
        n = abs(low + 1).bit_length() - 1
        low = int(from_plus_1) + (1 << (n - _digits(dtype) + 1))
    return low


def _update_to(high: int, dtype) -> int:
    to_minus_1 = _int_through_dtype(high - 1, dtype)
    if math.isfinite(to_minus_1) and int(to_minus_1) >= high:
        n = abs(high - 1).bit_length() - 1
        high = int(to_minus_1) - (1 << (n - _digits(dtype) + 1))
    return high


def _check_in_range(low: int, high_inclusive: int, dtype) -> None:
    if dtype.is_floating_point:
        lo, hi = -torch.finfo(dtype).max, torch.finfo(dtype).max
    elif dtype == torch.bool:
        lo, hi = 0, 1
    else:
        lo, hi = torch.iinfo(dtype).min, torch.iinfo(dtype).max
    for name, value in (("low", low), ("high - 1", high_inclusive)):
        if not lo <= value <= hi:
            raise ValueError(f"vescale.random kernel: random {name}={value} is out of bounds for {dtype}")


def _random_draw(dtype, low, high) -> Draw:
    """random_(), random_(from, to) and random_(from, None) as random_from_to_impl / random_impl resolve them."""
    _check_dtype("random", dtype, FLOAT_DTYPES + INTEGRAL_DTYPES)
    if low is None and high is None:  # random_(): the dtype's default range, 64-bit words for int64 / float64
        if dtype == torch.bool:
            modulus = 2  # uniform_int<bool>: val & 1
        elif dtype.is_floating_point:
            modulus = 2 ** _digits(dtype) + 1
        else:
            modulus = torch.iinfo(dtype).max + 1
        wide = dtype in (torch.int64, torch.float64)
        return Draw(OP_RANDOM, wide, 2 if wide else 4, modulus=modulus)
    low = 0 if low is None else _as_int("random low", low)
    if high is None:  # [low, max of dtype]
        if low == INT64_MIN:  # random_full_64_bits_range_kernel: every 64-bit value
            if dtype not in (torch.int64, torch.float64, torch.float32, torch.bfloat16):
                raise ValueError(f"vescale.random kernel: random over the full int64 range does not support {dtype}")
            return Draw(OP_RANDOM, True, 2, modulus=0)
        if dtype.is_floating_point:
            high_inclusive = min(2 ** _digits(dtype), INT64_MAX)
            low = _update_from(low, dtype)
            if low >= high_inclusive:
                raise ValueError(f"vescale.random kernel: random expects low < {high_inclusive} for {dtype}, got {low}")
        else:
            high_inclusive = 1 if dtype == torch.bool else torch.iinfo(dtype).max
        _check_in_range(low, high_inclusive, dtype)
        modulus = high_inclusive - low + 1
    else:
        high = _as_int("random high", high)
        if low >= high:
            raise ValueError(f"vescale.random kernel: random expects low < high, got low={low} >= high={high}")
        if dtype.is_floating_point:
            low, high = _update_from(low, dtype), _update_to(high, dtype)
            if low >= high:
                raise ValueError(f"vescale.random kernel: random bounds collapse in {dtype} (low={low}, high={high})")
        _check_in_range(low, high - 1, dtype)
        modulus = high - low
    wide = modulus >= 2**28  # random_from_to_kernel: "allow approx 5% skew", 64-bit words from here on
    return Draw(OP_RANDOM, wide, 2 if wide else 4, modulus=modulus % 2**64, base=low)


def _as_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise TypeError(f"vescale.random kernel: {name} must be an int, got {value!r}")
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"vescale.random kernel: {name} must fit int64, got {value}")
    return value


def resolve_draw(kind: str, dtype: torch.dtype, params: dict) -> Draw:
    """Validate ``params`` for ``kind`` and return the draw both implementations execute."""
    # A tensor p only matters by being a tensor; everything else is a hashable scalar (or a caller's mistake,
    # which the uncached call then reports). Items stay in the caller's order: each reader passes its
    # parameters in one fixed order, and another order only makes another cache entry with the same draw.
    items = tuple(params.items())
    if isinstance(params.get("p"), torch.Tensor):
        items = tuple((k, _TENSOR_P if k == "p" else v) for k, v in items)
    try:
        hash(items)
    except TypeError:
        return _resolve_draw.__wrapped__(kind, dtype, items)
    return _resolve_draw(kind, dtype, items)


_TENSOR_P = torch.empty(0)  # stands for "p is a tensor" in the cache key


@functools.lru_cache(maxsize=1024)  # the same few ops recur for every parameter of a model
def _resolve_draw(kind: str, dtype: torch.dtype, items: tuple) -> Draw:
    params = dict(items)
    expected = {
        "uniform": ({"low", "high"}, set()),
        "normal": ({"mean", "std"}, set()),
        "bernoulli": ({"p"}, set()),
        "random": (set(), {"low", "high"}),
    }
    if kind not in expected:
        raise ValueError(f"vescale.random kernel: unknown kind {kind!r}; use one of {KINDS}")
    required, optional = expected[kind]
    missing, unknown = required - params.keys(), params.keys() - required - optional
    if missing or unknown:
        raise TypeError(
            f"vescale.random kernel: {kind} takes parameters {sorted(required | optional)}; "
            f"missing {sorted(missing)}, unexpected {sorted(unknown)}"
        )
    if kind == "uniform":
        return _uniform_draw(dtype, params["low"], params["high"])
    if kind == "normal":
        return _normal_draw(dtype, params["mean"], params["std"])
    if kind == "bernoulli":
        return _bernoulli_draw(dtype, params["p"])
    return _random_draw(dtype, params.get("low"), params.get("high"))


# ---- launches: which counters each element uses --------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """One kernel launch over the flat global range [start, start + numel)."""

    start: int
    numel: int
    threads: int  # T
    counter: int  # first Philox counter (offset / 4) of every thread's stream


def _grid_stride_increment(numel: int, unroll: int, profile: DeviceProfile) -> int:
    return ((numel - 1) // (profile.num_threads(numel) * unroll) + 1) * 4


def _fits_32bit_indexing(numel: int, itemsize: int) -> bool:
    # TensorIteratorBase::can_use_32bit_indexing for a contiguous (coalesced to 1-D) tensor
    return numel <= INT32_MAX and 1 + (numel - 1) * itemsize <= INT32_MAX


def _launches(numel: int, itemsize: int, unroll: int, offset: int, profile: DeviceProfile):
    """The launches a grid-stride op over ``numel`` elements makes, and the total offset increment."""
    at_zero, increment = _launches_at_offset_zero(numel, itemsize, unroll, profile)
    if offset == 0:
        return list(at_zero), increment
    # Every counter is (offset + increment so far) / 4 with both terms multiples of 4: shift by offset / 4.
    shift = offset // 4
    return [Launch(launch.start, launch.numel, launch.threads, launch.counter + shift) for launch in at_zero], increment


def split_for_32bit_indexing(numel: int, itemsize: int) -> list[tuple[int, int]]:
    """(start, size) pieces of an op too large for 32-bit indexing, as PyTorch's SplitUntil32Bit
    makes them: halved depth first, the first half (numel // 2) first."""
    pieces, stack = [], [(0, numel)]
    while stack:
        start, size = stack.pop()
        if _fits_32bit_indexing(size, itemsize):
            pieces.append((start, size))
        else:
            half = size // 2
            stack += [(start + half, size - half), (start, half)]
    return pieces


@functools.lru_cache(maxsize=1024)  # depends only on the op's global size, dtype width and profile: recurs every step
def _launches_at_offset_zero(numel: int, itemsize: int, unroll: int, profile: DeviceProfile):
    increment = _grid_stride_increment(numel, unroll, profile)
    if _fits_32bit_indexing(numel, itemsize):
        return (Launch(0, numel, profile.num_threads(numel), 0),), increment
    launches = []
    for start, size in split_for_32bit_indexing(numel, itemsize):
        launches.append(Launch(start, size, profile.num_threads(size), increment // 4))
        increment += _grid_stride_increment(size, unroll, profile)
    return tuple(launches), increment


def offset_increment(kind: str, dtype: torch.dtype, numel: int, profile: DeviceProfile, **params: Any) -> int:
    """How far the generator offset advances after drawing ``numel`` values of this kind (0 when empty).

    ``params`` are generate's (bernoulli's ``p`` decides the kernel: a float, or a tensor)."""
    draw = resolve_draw(kind, dtype, params)
    if numel < 0:
        raise ValueError(f"vescale.random kernel: numel must be >= 0, got {numel}")
    if numel == 0:
        return 0
    if draw.op == OP_BERNOULLI_TENSOR:
        return BERNOULLI_TENSOR_INCREMENT
    return _launches_at_offset_zero(numel, dtype.itemsize, draw.unroll, profile)[1]


# ---- generate ------------------------------------------------------------------------------------------


def _scan_index_torch(index: torch.Tensor):
    from vescale.random._native import IndexScan  # a plain NamedTuple; importing _native builds nothing

    low, high = torch.aminmax(index)
    step_one = index.numel() == 1 or bool((index[1:] - index[:-1] == 1).all())
    return IndexScan(int(low), int(high), step_one)


class Block:
    """Which elements of a global tensor a fill draws, validated and scanned once so it can be reused.

    ``dim_indices``: per global dim, the 1-D int64 CPU tensor of global indices the local block holds
    (None: the whole tensor). Element (c_0..c_{D-1}) of the block is global flat index
    sum_d dim_indices[d][c_d] * global_stride[d]. A Block depends only on the global shape and the
    indices, never on the op, the dtype or the generator state, so a caller that draws the same block
    again (the DTensor handlers do, every training step) builds it once and passes it to
    :func:`generate` in place of ``dim_indices``. The kernels' layout (per-dim runs, see
    ``_native.local_layout``) is computed on first use and kept, per device. The index tensors must not
    be modified afterwards.
    """

    __slots__ = ("global_shape", "global_numel", "dim_indices", "scans", "shape", "_layouts")

    def __init__(self, global_shape: Sequence[int], dim_indices: Sequence[torch.Tensor] | None, scan_index=None):
        global_shape = tuple(global_shape)
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in global_shape):
            raise ValueError(f"vescale.random kernel: global_shape must hold non-negative ints, got {global_shape}")
        self.global_shape, self.global_numel = global_shape, math.prod(global_shape)
        self._layouts: dict = {}
        if dim_indices is None:
            self.dim_indices, self.scans, self.shape = None, None, global_shape
            return
        self.dim_indices, self.scans = _checked_indices(global_shape, dim_indices, scan_index or _scan_index_torch)
        self.shape = tuple(index.numel() for index in self.dim_indices)

    def layout(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(row_base, inner_off, run) of ``_native.local_layout``, the tensors on ``device`` (default CPU)."""
        key = None if device is None or device.type == "cpu" else device
        layout = self._layouts.get(key)
        if layout is None:
            if key is None:
                from vescale.random._native import local_layout  # plain tensor code; builds nothing

                layout = local_layout(self.global_shape, self.dim_indices, self.scans)
            else:
                row_base, inner_off, run = self.layout()
                layout = (row_base.to(device), inner_off.to(device), run)
            self._layouts[key] = layout
        return layout


def _checked_indices(global_shape: tuple, dim_indices, scan_index):
    """Contiguous copies-or-views of ``dim_indices`` and their scans, or a ValueError naming the bad one."""
    dim_indices = list(dim_indices)
    if len(dim_indices) != len(global_shape):
        raise ValueError(
            f"vescale.random kernel: dim_indices needs one index tensor per global dim ({len(global_shape)}), "
            f"got {len(dim_indices)}"
        )
    scans = []
    for d, (index, size) in enumerate(zip(dim_indices, global_shape)):
        if not isinstance(index, torch.Tensor) or index.dtype != torch.int64 or index.dim() != 1:
            raise ValueError(f"vescale.random kernel: dim_indices[{d}] must be a 1-D int64 tensor")
        if index.device.type != "cpu":
            raise ValueError(f"vescale.random kernel: dim_indices[{d}] must be on the CPU, got {index.device}")
        index = dim_indices[d] = index.contiguous()
        scans.append(scan_index(index) if index.numel() else None)
        if index.numel() and (scans[d][0] < 0 or scans[d][1] >= size):
            raise ValueError(f"vescale.random kernel: dim_indices[{d}] holds indices outside [0, {size})")
    return dim_indices, scans


def _check_generate_args(out, seed, offset, global_shape, block: Block, devices=("cpu",)) -> None:
    if not isinstance(out, torch.Tensor) or out.device.type not in devices or not out.is_contiguous():
        raise ValueError(f"vescale.random kernel: out must be a contiguous tensor on {' or '.join(devices)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"vescale.random kernel: seed must be an int in [0, 2**64), got {seed!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < 2**62 or offset % 4:
        raise ValueError(f"vescale.random kernel: offset must be a multiple of 4 in [0, 2**62), got {offset!r}")
    if tuple(global_shape) != block.global_shape:
        raise ValueError(
            f"vescale.random kernel: global_shape {tuple(global_shape)} is not the shape of the block's global "
            f"tensor {block.global_shape}"
        )
    if out.shape != block.shape:
        if block.dim_indices is None:
            raise ValueError(
                f"vescale.random kernel: with dim_indices=None out must have the global shape {block.global_shape}, "
                f"got {tuple(out.shape)}"
            )
        raise ValueError(
            f"vescale.random kernel: out has shape {tuple(out.shape)} but dim_indices select {block.shape}"
        )


def _probabilities(p: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """bernoulli_kernel casts p to float64 for a float64 result and to float32 for every other dtype."""
    if tuple(p.shape) != tuple(out.shape):
        raise ValueError(f"vescale.random kernel: bernoulli p has shape {tuple(p.shape)}, out has {tuple(out.shape)}")
    if not p.dtype.is_floating_point:
        raise ValueError(f"vescale.random kernel: bernoulli p must have a floating dtype, got {p.dtype}")
    prob = p.detach().to(device=out.device, dtype=torch.float64 if out.dtype == torch.float64 else torch.float32)
    prob = prob.contiguous()
    if prob.numel() and not bool(((prob >= 0) & (prob <= 1)).all()):
        raise ValueError("vescale.random kernel: bernoulli p values must lie in [0, 1]")
    return prob


def generate(
    out: torch.Tensor,
    kind: str,
    *,
    seed: int,
    offset: int,
    global_shape: Sequence[int],
    dim_indices: Sequence[torch.Tensor] | None,
    profile: DeviceProfile,
    backend: str = "auto",
    **params: Any,
) -> None:
    """Fill ``out`` in place with its block of the global random tensor.

    The local element at coords (c_0..c_{D-1}) gets the value of global element
    j = sum_d dim_indices[d][c_d] * global_stride[d] (C-contiguous global strides). Work is O(local
    elements); the global tensor is never built. ``params``: uniform ``low, high``; normal ``mean, std``;
    bernoulli ``p`` (float, or a tensor of out's shape); random ``low, high`` (ints, high exclusive;
    both omitted: random_(); ``high=None``: up to the dtype's maximum). ``backend``: "auto" (a CUDA ``out``:
    the Triton kernel; a CPU one: the compiled C kernel when available, else the PyTorch path), "native"
    (compiled C kernel, error if it cannot be built), "torch", or "triton" (the Triton kernel; on a CPU
    ``out`` it runs in Triton's interpreter, which is how tests check it). All give the same bits.
    ``dim_indices`` may also be a :class:`Block` of ``global_shape`` built earlier: its validation, scans
    and layout are then reused instead of recomputed."""
    if backend not in BACKENDS:
        raise ValueError(f"vescale.random kernel: backend must be one of {BACKENDS}, got {backend!r}")
    on_cuda = isinstance(out, torch.Tensor) and out.device.type == "cuda"
    if on_cuda and backend == "auto":
        from vescale.random import _triton

        if not _triton.available():
            _warn_no_triton()
            return _generate_on_cpu_and_copy(out, kind, seed, offset, global_shape, dim_indices, profile, params)
        backend = "triton"
    native = None
    if backend in ("auto", "native") or (backend == "triton" and not on_cuda):
        from vescale.random import _native  # imported here: building it is a first-use cost, not an import one

        native = _native.load(required=backend == "native")
    if isinstance(dim_indices, Block):
        block = dim_indices
    else:
        block = Block(global_shape, dim_indices, native.scan_index if native is not None else _scan_index_torch)
    devices = ("cpu", "cuda") if backend == "triton" else ("cpu",)
    _check_generate_args(out, seed, offset, global_shape, block, devices)
    draw = resolve_draw(kind, out.dtype, params)
    prob = _probabilities(params["p"], out) if draw.op == OP_BERNOULLI_TENSOR else None
    if out.numel() == 0:
        return
    numel = block.global_numel
    if draw.op == OP_BERNOULLI_TENSOR:
        launches = [Launch(0, numel, 0, offset // 4)]  # threads unused: the mapping is j -> (j // 4, j % 4)
    else:
        launches = _launches(numel, out.element_size(), draw.unroll, offset, profile)[0]
    if backend == "triton":
        from vescale.random import _triton

        _triton.fill(out, draw, seed, launches, block, prob)
    elif native is not None:
        native.fill(out, draw, seed, launches, block, prob)
    else:
        _fill_torch(out, draw, seed, launches, block, prob)


BACKENDS = ("auto", "native", "torch", "triton")


@functools.lru_cache(maxsize=1)  # once per process
def _warn_no_triton() -> None:
    warnings.warn(
        "vescale.random: triton is not installed, so random ops on CUDA tensors are drawn on the CPU and "
        "copied to the GPU (same values, slower). Install triton to draw them on the GPU.",
        RuntimeWarning,
        stacklevel=4,
    )


def _generate_on_cpu_and_copy(out, kind, seed, offset, global_shape, dim_indices, profile, params) -> None:
    buffer = torch.empty(out.shape, dtype=out.dtype)
    if isinstance(params.get("p"), torch.Tensor):
        params = dict(params, p=params["p"].cpu())
    generate(buffer, kind, seed=seed, offset=offset, global_shape=global_shape, dim_indices=dim_indices,
             profile=profile, **params)
    out.copy_(buffer)


# ---- the pure-PyTorch path ---------------------------------------------------------------------------


def flat_indices(global_shape: Sequence[int], dim_indices: Sequence[torch.Tensor] | None) -> torch.Tensor:
    """Global C-order flat index of every local element, in local C order (1-D int64)."""
    numel = math.prod(global_shape)
    if dim_indices is None:
        return torch.arange(numel, dtype=torch.int64)
    flat = torch.zeros((), dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(global_shape))):
        shape = [1] * len(global_shape)
        shape[d] = -1
        flat = flat + dim_indices[d].view(shape) * stride
        stride *= global_shape[d]
    return flat.reshape(-1)


def _counters(j: torch.Tensor, draw: Draw, launches):
    """(counter lo64, thread, word index ii) of each element's Philox call."""
    if draw.op == OP_BERNOULLI_TENSOR:
        return torch.full_like(j, launches[0].counter), j >> 2, j & 3
    if len(launches) == 1:
        local, threads, counter = j, launches[0].threads, launches[0].counter
    else:
        starts = torch.tensor([launch.start for launch in launches[1:]], dtype=torch.int64)
        which = torch.searchsorted(starts, j, right=True)
        local = j - torch.tensor([launch.start for launch in launches])[which]
        threads = torch.tensor([launch.threads for launch in launches])[which]
        counter = torch.tensor([launch.counter for launch in launches])[which]
    step = local // threads
    return counter + step // draw.unroll, local % threads, step % draw.unroll


def _select(words, ii: torch.Tensor) -> torch.Tensor:
    return torch.stack(words).gather(0, ii.unsqueeze(0)).squeeze(0)


def _u64_add(a: torch.Tensor, b: int) -> torch.Tensor:
    """(a + b) mod 2**64 for int64 bit patterns, without signed overflow."""
    mask = philox.MASK32
    b_unsigned = b % 2**64
    lo = (a & mask) + (b_unsigned & mask)
    hi = ((a >> 32) & mask) + (b_unsigned >> 32) + (lo >> 32)
    return _join_u32(hi & mask, lo & mask)


def _join_u32(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """int64 bit pattern of hi * 2**32 + lo (both in [0, 2**32))."""
    return torch.where(hi >= 2**31, hi - 2**32, hi) * 2**32 + lo


def _accumulate(draw: Draw, words, ii: torch.Tensor, prob):
    """The value of each element before the final cast: float32, float64, int64 or bool."""
    w0, w1, w2, w3 = words
    if draw.op == OP_BERNOULLI_TENSOR:
        u = philox.uniform_float(_select(words, ii))
        return u.to(prob.dtype).reshape(-1) <= prob.reshape(-1)
    if not draw.wide:
        if draw.op == OP_NORMAL:
            pair = ii >> 1
            z = philox.normal_float(_select(words, 2 * pair), _select(words, 2 * pair + 1), (ii & 1) == 1)
            return philox.fma_float(z, _f32(draw.b), _f32(draw.a))
        word = _select(words, ii)
        if draw.op == OP_UNIFORM:
            return philox.fma_float(philox.uniform_float(word), _f32(draw.b), _f32(draw.a))
        if draw.op == OP_BERNOULLI:
            return philox.uniform_float(word) < draw.a
        return word % draw.modulus + draw.base  # OP_RANDOM: 32-bit word, modulus < 2**32
    if draw.op == OP_NORMAL:
        z = philox.normal_double(w0, w1, w2, w3, ii == 1)
        return philox.fma_double(z, _f64(draw.b), _f64(draw.a))
    first, second = _select(words, 2 * ii), _select(words, 2 * ii + 1)
    if draw.op == OP_UNIFORM:
        return philox.fma_double(philox.uniform_double(first, second), _f64(draw.b), _f64(draw.a))
    if draw.op == OP_BERNOULLI:
        return philox.uniform_double(first, second) < draw.a
    bits = _join_u32(first, second)  # random_from_to: (x << 32) | y, the first word high
    if draw.modulus:
        bits = philox.u64_mod(bits, draw.modulus)
    return _u64_add(bits, draw.base)


def _f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def _f64(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64)


def _cast(values: torch.Tensor, draw: Draw, dtype: torch.dtype) -> torch.Tensor:
    """Round the accumulated values to the output dtype as the CUDA kernels do."""
    if values.dtype == torch.int64 and dtype.is_floating_point and dtype != torch.float64:
        values = values.to(torch.float32)  # int64 -> float -> Half / BFloat16 (c10 types are built from float)
    result = values.to(dtype)
    if draw.op == OP_UNIFORM:  # a value that rounds to `to` becomes `from` (compared in the dtype)
        result = torch.where(result.to(torch.float64) == draw.c, torch.tensor(draw.a, dtype=dtype), result)
    return result


def _fill_torch(out, draw: Draw, seed: int, launches, block: Block, prob) -> None:
    j = flat_indices(block.global_shape, block.dim_indices)
    counter, thread, ii = _counters(j, draw, launches)
    mask = philox.MASK32
    words = philox.philox4x32_10(counter & mask, counter >> 32, thread & mask, thread >> 32, seed & mask, seed >> 32)
    out.copy_(_cast(_accumulate(draw, words, ii, prob), draw, out.dtype).view(out.shape))
