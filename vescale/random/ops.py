"""The aten random ops vescale.random draws itself, and how one call of them is drawn.

Every user-level random call (``Tensor.uniform_``, ``nn.init.*``, ``rand_like``, dropout, ...) reaches
one of the aten ops in ``SUPPORTED``. :func:`read_call` turns a call into a :class:`RandomCall`: what
to draw (kernel kind and scalar parameters), over which global shape and dtype, and where the result
goes. :func:`fill` draws any block of the global tensor from vescale's generator. The DTensor
handlers (``dtensor.py``) and ``consistent()`` differ only in which block a call fills and how the
result is wrapped; :class:`RandomOpMode` routes the calls on plain tensors.

Random ops we cannot draw with single-device semantics (``UNSUPPORTED``: exponential_, multinomial,
normal with tensor mean/std, ...) raise instead of silently drawing rank-local numbers.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from vescale._torch import _len_torch_dispatch_stack_pre_dispatch, TorchDispatchMode, _disable_current_modes, tree_leaves

from vescale.memo import Memo
from vescale.random import generator, kernel

__all__ = ["RandomCall", "RandomOpMode", "SUPPORTED", "UNSUPPORTED", "bind", "fill", "read_call", "run_on_plain"]

aten = torch.ops.aten


@dataclass
class RandomCall:
    """One call of a supported random op, read into what to draw and where it goes."""

    op: torch._ops.OpOverload
    kind: str  # kernel.generate kind: "uniform" | "normal" | "bernoulli" | "random"
    params: dict  # the kind's scalar parameters (low/high, mean/std, p)
    dtype: torch.dtype  # dtype of the drawn values
    shape: tuple[int, ...]  # shape of the whole random tensor (global for a DTensor)
    target: torch.Tensor | None = None  # in-place ops: the tensor to overwrite
    like: torch.Tensor | None = None  # out-of-place ops: the result takes this tensor's shape and layout
    prob: torch.Tensor | None = None  # bernoulli with tensor p: probabilities, broadcastable to shape
    dropout_scale: float | None = None  # native_dropout: output = like * mask * scale, mask drawn as fp32
    device: torch.device | None = None  # factories, and *_like ops given device=
    memory_format: torch.memory_format | None = None
    generator: torch.Generator | None = None
    train: bool = True  # native_dropout(train=False) draws nothing and returns (input.clone(), ones)


def bind(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict:
    """Name every argument of ``op`` (defaults filled in) so each reader looks arguments up by name."""
    bound = {}
    for i, (name, kwarg_only, default) in enumerate(_schema_arguments(op)):
        if i < len(args) and not kwarg_only:
            bound[name] = args[i]
        elif name in kwargs:
            bound[name] = kwargs[name]
        else:
            bound[name] = default
    return bound


@functools.lru_cache(maxsize=None)  # one entry per random op overload; reading a schema builds new objects
def _schema_arguments(op: torch._ops.OpOverload) -> tuple:
    return tuple(
        (arg.name, arg.kwarg_only, arg.default_value if arg.has_default_value() else None)
        for arg in op._schema.arguments
    )


def without_dispatch_modes() -> contextlib.AbstractContextManager:
    """``_disable_current_modes()`` when a dispatch mode is active, else a no-op context: plain tensor code
    run by vescale.random itself must not reach any mode (ours included), and toggling an empty mode
    stack costs more than a small random op."""
    if torch._C._len_torch_dispatch_stack() or _len_torch_dispatch_stack_pre_dispatch():
        return _disable_current_modes()
    return contextlib.nullcontext()


# (op, dtype, typed scalars) that PyTorch's own checks accepted; a model uses a handful
_VALID_SCALARS = Memo("accepted random-op scalars", 4096)


def _check_like_native(inplace_op, dtype: torch.dtype, *scalars) -> None:
    # Let PyTorch's own kernel validate the arguments (same checks, same messages) on an empty tensor:
    # the checks run before the "empty tensor: nothing to draw" early return, so no generator moves.
    # Acceptance depends only on (op, dtype, scalars), so an accepted combination is not checked again;
    # the key holds each scalar's type too (True, 1 and 1.0 hash alike but need not check alike).
    key = (inplace_op, dtype, tuple((type(v), v) for v in scalars))
    if key in _VALID_SCALARS:  # an unhashable argument is never in: checked every time
        return
    with without_dispatch_modes():
        inplace_op(torch.empty(0, dtype=dtype), *scalars)
    _VALID_SCALARS.put(key, True)


def _check_layout(b: dict, op) -> None:
    if b.get("layout") not in (None, torch.strided):
        raise NotImplementedError(f"vescale.random: {op} supports strided tensors only, got layout={b['layout']}")


def _dtype_of(b: dict, fallback: torch.dtype) -> torch.dtype:
    return b["dtype"] if isinstance(b.get("dtype"), torch.dtype) else fallback


def _random_params(dtype: torch.dtype, low: int | None, high: int | None) -> dict:
    """random_ / randint parameters; low=None means random_() with no bounds (the dtype's default range)."""
    if low is None:
        _check_like_native(aten.random_.default, dtype)
        return {}
    _check_like_native(getattr(aten.random_, "from"), dtype, low, high)
    return {"low": low, "high": high}


# ---- readers: one per op family; each returns the RandomCall for a bound call -------------------------


def _uniform(op, b, inplace):
    self = b["self"]
    _check_like_native(aten.uniform_.default, self.dtype, b["from"], b["to"])
    return _on_self(op, b, inplace, "uniform", {"low": b["from"], "high": b["to"]})


def _normal(op, b, inplace):
    self = b["self"]
    _check_like_native(aten.normal_.default, self.dtype, b["mean"], b["std"])
    return _on_self(op, b, inplace, "normal", {"mean": b["mean"], "std": b["std"]})


def _bernoulli_float(op, b, inplace):
    _check_like_native(aten.bernoulli_.float, b["self"].dtype, b["p"])
    return _on_self(op, b, inplace, "bernoulli", {"p": b["p"]})


def _bernoulli_tensor(op, b, inplace):
    # bernoulli(self): self holds the probabilities; bernoulli_(self, p) / bernoulli(self, p): p does.
    prob = b["p"] if "p" in b else b["self"]
    if not isinstance(prob, torch.Tensor):
        raise TypeError(f"vescale.random: {op} expects a tensor of probabilities, got {type(prob).__name__}")
    call = _on_self(op, b, inplace, "bernoulli", {})
    call.prob = prob
    return call


def _random(op, b, inplace):
    self = b["self"]
    if "from" in b:
        low, high = b["from"], b["to"]
    elif "to" in b:
        low, high = 0, b["to"]
    else:
        low = high = None
    return _on_self(op, b, inplace, "random", _random_params(self.dtype, low, high))


def _on_self(op, b, inplace, kind, params) -> RandomCall:
    self = b["self"]
    call = RandomCall(op, kind, params, self.dtype, tuple(self.shape), generator=b.get("generator"))
    if inplace:
        call.target = self
    else:
        call.like = self
    return call


def _like(kind: str, params_of: Callable[[dict, torch.dtype], dict], default_dtype=None):
    def read(op: torch._ops.OpOverload, b: dict, inplace: bool) -> RandomCall:
        _check_layout(b, op)
        self = b["self"]
        dtype = _dtype_of(b, default_dtype or self.dtype)
        call = RandomCall(op, kind, params_of(b, dtype), dtype, tuple(self.shape), like=self)
        call.device = b.get("device")
        call.memory_format = b.get("memory_format")
        return call

    return read


def _factory(kind: str, params_of: Callable[[dict, torch.dtype], dict], default_dtype=None):
    def read(op: torch._ops.OpOverload, b: dict, inplace: bool) -> RandomCall:
        _check_layout(b, op)
        dtype = _dtype_of(b, default_dtype or torch.get_default_dtype())
        call = RandomCall(op, kind, params_of(b, dtype), dtype, tuple(int(s) for s in b["size"]))
        call.device = torch.device(b["device"]) if b.get("device") is not None else None
        call.generator = b.get("generator")
        return call

    return read


def _randint_high(b) -> int:
    high = b["high"]
    return int(high.item()) if isinstance(high, torch.Tensor) else int(high)


def _native_dropout(op, b, inplace):
    x, p = b["input"], b["p"]
    _check_like_native(aten.bernoulli_.float, torch.float32, 1.0 - p)
    keep = 1.0 - p
    # The mask is drawn as float32 bernoulli(keep) whatever the input dtype, as CUDA's dropout kernel
    # draws fp32 uniforms; a zero keep probability scales by 0 rather than dividing by zero (as PyTorch).
    call = RandomCall(op, "bernoulli", {"p": keep}, torch.float32, tuple(x.shape), like=x)
    call.dropout_scale = 0.0 if keep == 0 else 1.0 / keep
    call.train = b["train"] is None or bool(b["train"])
    return call


_UNIFORM01 = lambda b, dtype: {"low": 0.0, "high": 1.0}  # noqa: E731
_NORMAL01 = lambda b, dtype: {"mean": 0.0, "std": 1.0}  # noqa: E731
_INT64 = torch.int64  # randint's schema default (ScalarType 4) is int64

SUPPORTED: dict[torch._ops.OpOverload, tuple[Callable, bool]] = {
    # op: (reader, in_place)
    aten.uniform_.default: (_uniform, True),
    aten.uniform.default: (_uniform, False),
    aten.normal_.default: (_normal, True),
    aten.bernoulli_.float: (_bernoulli_float, True),
    aten.bernoulli.p: (_bernoulli_float, False),
    aten.bernoulli_.Tensor: (_bernoulli_tensor, True),
    aten.bernoulli.Tensor: (_bernoulli_tensor, False),
    aten.bernoulli.default: (_bernoulli_tensor, False),
    aten.random_.default: (_random, True),
    aten.random_.to: (_random, True),
    # "from" is a Python keyword. getattr (not packet.__getattr__, which builds a new overload object
    # and replaces PyTorch's cached one) keeps the very object DTensor looks handlers up by.
    getattr(aten.random_, "from"): (_random, True),
    aten.random.default: (_random, False),
    aten.random.to: (_random, False),
    getattr(aten.random, "from"): (_random, False),
    aten.rand_like.default: (_like("uniform", _UNIFORM01), False),
    aten.randn_like.default: (_like("normal", _NORMAL01), False),
    aten.randint_like.default: (_like("random", lambda b, d: _random_params(d, 0, _randint_high(b))), False),
    aten.randint_like.Tensor: (_like("random", lambda b, d: _random_params(d, 0, _randint_high(b))), False),
    aten.randint_like.low_dtype: (
        _like("random", lambda b, d: _random_params(d, int(b["low"]), int(b["high"]))),
        False,
    ),
    aten.native_dropout.default: (_native_dropout, False),
    aten.rand.default: (_factory("uniform", _UNIFORM01), False),
    aten.randn.default: (_factory("normal", _NORMAL01), False),
    aten.randint.default: (_factory("random", lambda b, d: _random_params(d, 0, int(b["high"])), _INT64), False),
    aten.randint.low: (
        _factory("random", lambda b, d: _random_params(d, int(b["low"]), int(b["high"])), _INT64),
        False,
    ),
    aten.normal.float_float: (
        _factory("normal", lambda b, d: _checked_normal(d, b["mean"], b["std"])),
        False,
    ),
}


def _checked_normal(dtype, mean, std) -> dict:
    _check_like_native(aten.normal_.default, dtype, mean, std)
    return {"mean": mean, "std": std}


# Every other overload of a distribution op. Calls with an explicit generator= are passed through to
# PyTorch by consistent() (they draw from the user's generator); everything else raises.
_DISTRIBUTION_OPS = (
    "uniform_ uniform normal_ normal bernoulli_ bernoulli random_ random rand randn randint rand_like "
    "randn_like randint_like randperm native_dropout _fused_dropout exponential_ exponential cauchy_ cauchy "
    "log_normal_ log_normal geometric_ geometric multinomial poisson binomial _standard_gamma "
    "_sample_dirichlet rrelu_with_noise rrelu_with_noise_"
).split()

UNSUPPORTED: frozenset = frozenset(
    getattr(getattr(aten, name), overload)
    for name in _DISTRIBUTION_OPS
    if hasattr(aten, name)
    for overload in getattr(aten, name).overloads()
) - frozenset(SUPPORTED)


def unsupported_error(op: torch._ops.OpOverload) -> NotImplementedError:
    hint = ""
    if op.name() == "aten::normal":
        hint = " Write torch.randn_like(mean) * std + mean instead."
    return NotImplementedError(
        f"vescale.random: {op} has no single-device-semantic implementation, so it would draw different "
        f"numbers on each rank and on a single device.{hint} Supported ops: uniform_, normal_, bernoulli(_), "
        "random_, rand(_like), randn(_like), randint(_like), native_dropout and what builds on them "
        "(nn.init.*, dropout)."
    )


def read_call(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> RandomCall:
    reader, inplace = SUPPORTED[op]
    return reader(op, bind(op, args, kwargs), inplace)


# ---- drawing -------------------------------------------------------------------------------------------


def fill(
    out: torch.Tensor,
    call: RandomCall,
    global_shape: Sequence[int],
    dim_indices: Sequence[torch.Tensor] | kernel.Block | None,
    prob: torch.Tensor | None = None,
) -> None:
    """Fill ``out`` with the block ``dim_indices`` (index tensors, or a prepared ``kernel.Block``) of the
    global random tensor ``call`` asks for, and advance the generator past the whole tensor. ``prob``
    holds bernoulli's per-element probabilities for the block (out's shape)."""
    if out.is_meta:
        return  # like PyTorch's meta kernels: nothing drawn, the generator does not move
    params = call.params if prob is None else dict(call.params, p=prob)
    with generator.reserve(call.kind, out.dtype, global_shape, **params) as draw:
        if out.numel() == 0:
            return
        # The kernel's own tensor ops are plain arithmetic: no dispatch mode (ours included) may see them.
        with without_dispatch_modes():
            # CUDA tensors are drawn on their device (the Triton kernel), everything else on the CPU
            device_type = out.device.type
            direct = device_type in ("cpu", "cuda") and out.is_contiguous()
            if direct:
                buf = out
            else:
                buf = torch.empty(out.shape, dtype=out.dtype, device=out.device if device_type == "cuda" else "cpu")
            kernel.generate(
                buf,
                call.kind,
                seed=draw.seed,
                offset=draw.offset,
                global_shape=tuple(global_shape),
                dim_indices=dim_indices,
                profile=draw.profile,
                **params,
            )
            if not direct:
                out.copy_(buf)


def select_block(tensor: torch.Tensor, shape: Sequence[int], dim_indices: Sequence[torch.Tensor] | None) -> torch.Tensor:
    """The block ``dim_indices`` of ``tensor`` broadcast to the global ``shape`` (a plain tensor)."""
    full = tensor.expand(tuple(shape))
    if dim_indices is None:
        return full
    for d, index in enumerate(dim_indices):
        full = full.index_select(d, index.to(full.device))
    return full


def dropout_output(x: torch.Tensor, mask_f32: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """native_dropout's results from the input and the drawn float32 0/1 mask (PyTorch's formula)."""
    output = x.mul(mask_f32.to(device=x.device, dtype=x.dtype)).mul_(scale)
    return output, mask_f32.to(device=x.device, dtype=torch.bool)


Block = Callable[[Sequence[int]], tuple[Sequence[int], Sequence[torch.Tensor] | None]]


def whole_tensor(shape: Sequence[int]) -> tuple[tuple[int, ...], None]:
    """The block of a plain tensor in consistent(): the whole tensor is the global tensor."""
    return tuple(shape), None


def run_on_plain(call: RandomCall, block: Block = whole_tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run ``call`` on plain tensors; ``block(local_shape)`` says which block of which global tensor
    the op's tensor is (the whole tensor in consistent(), the rank's shard in a DTensor factory)."""
    if not call.train:
        x = call.like
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    if call.target is not None:
        out = call.target
    elif call.like is not None:
        out = torch.empty_like(
            call.like,
            dtype=call.dtype,
            device=call.device or call.like.device,
            memory_format=call.memory_format or torch.preserve_format,
        )
    else:
        out = torch.empty(call.shape, dtype=call.dtype, device=call.device)
    global_shape, dim_indices = block(tuple(out.shape))
    prob = None if call.prob is None else select_block(call.prob, out.shape, None)
    fill(out, call, global_shape, dim_indices, prob)
    if call.dropout_scale is not None:
        return dropout_output(call.like, out, call.dropout_scale)
    return out


def _has_dtensor(args, kwargs) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(leaf, DTensor) for leaf in tree_leaves((args, kwargs)))


class RandomOpMode(TorchDispatchMode):
    """Routes random ops on plain tensors to vescale's generator while active.

    ``block`` maps the op's tensor shape to (global shape, dim_indices). Calls given an explicit
    ``generator=`` go to PyTorch unchanged. Calls on DTensors go to :meth:`on_dtensor` (by default
    to DTensor's own dispatch, where vescale's handlers take them when installed).
    """

    def __init__(self, block: Block = whole_tensor):
        super().__init__()
        self.block = block

    def on_dtensor(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        return func(*args, **kwargs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in SUPPORTED and func not in UNSUPPORTED:
            return func(*args, **kwargs)
        if _has_dtensor(args, kwargs):
            return self.on_dtensor(func, args, kwargs)
        if bind(func, args, kwargs).get("generator") is not None:
            return func(*args, **kwargs)
        if func in UNSUPPORTED:
            raise unsupported_error(func)
        return run_on_plain(read_call(func, args, kwargs), self.block)
