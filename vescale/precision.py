"""Mixed precision: compute in a low-precision dtype, keep fp32 master parameters.

``MixedPrecision`` is the policy (FSDP2's ``MixedPrecisionPolicy`` as the model): parameters are
kept, stepped and checkpointed in their own dtype (the fp32 *masters*); each module's forward runs
with them cast to ``param_dtype``; gradients are reduced across ranks in ``reduce_dtype`` and land
in ``param.grad`` in the master's dtype, so a stock torch optimizer steps the masters.

The policy is defined on one device first (``apply_mixed_precision``): a plain model runs each
module's forward with its own floating-point parameters cast to ``param_dtype`` (an autograd cast:
the gradient flows back to the fp32 parameter), floating-point root inputs cast to ``param_dtype``
and root outputs to ``output_dtype``. That run is "the single-device result" a parallel run with
the same policy (``vescale.parallelize(..., mixed_precision=policy)``) is compared with. The
parallel run uses the same hooks; what differs is where the cast happens for ZeRO-3 parameters (on
the shard, before the gather: the gather moves ``param_dtype`` bytes) and that gradient reductions
(bucketed or per tensor) run in ``reduce_dtype``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn as nn
from vescale.model_state import state_of

__all__ = ["MixedPrecision", "apply_mixed_precision"]

_FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """A mixed-precision policy.

    * ``param_dtype``: the dtype modules compute with (their parameters are cast to it for the
      forward; ZeRO-3 gathers move it). ``None``: the parameters' own dtype (no cast).
    * ``reduce_dtype``: the dtype gradients are reduced across ranks in (all-reduce and
      reduce-scatter). ``None``: ``param_dtype`` (FSDP2's rule), or the parameter's own dtype.
    * ``output_dtype``: floating-point outputs of the root module are cast to it (``None``: as computed).
    * ``cast_forward_inputs``: floating-point inputs of the root module are cast to ``param_dtype``.

    Parameters, gradients (``param.grad``) and optimizer state stay in the parameters' own dtype.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, field)
            if value is not None and value not in _FLOATS:
                raise ValueError(
                    f"MixedPrecision({field}={value!r}): use a floating-point torch dtype "
                    f"({', '.join(map(str, _FLOATS))}) or None"
                )

    def compute_dtype(self, t: torch.Tensor) -> torch.dtype:
        """The dtype ``t`` is computed with: ``param_dtype`` for a floating-point parameter."""
        if self.param_dtype is not None and isinstance(t, nn.Parameter) and t.is_floating_point():
            return self.param_dtype
        return t.dtype

    def grad_dtype(self, param: torch.Tensor) -> torch.dtype:
        """The dtype ``param``'s gradient is reduced in across ranks."""
        if not param.is_floating_point():
            return param.dtype
        return self.reduce_dtype or self.param_dtype or param.dtype


def compute_dtype_of(policy: Optional[MixedPrecision], t: torch.Tensor) -> torch.dtype:
    """``policy.compute_dtype(t)``, or ``t``'s own dtype without a policy."""
    return t.dtype if policy is None else policy.compute_dtype(t)


def reduce_dtype_of(policy: Optional[MixedPrecision], param: torch.Tensor) -> torch.dtype:
    """``policy.grad_dtype(param)``, or ``param``'s own dtype without a policy."""
    return param.dtype if policy is None else policy.grad_dtype(param)


def _cast_floats(obj, dtype: torch.dtype):
    from .parallel.hooks import _map_tensors  # the walk over outputs vescale's hooks use

    return _map_tensors(lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t, obj)


def _cast_parameters(module: nn.Module, policy: MixedPrecision) -> list:
    """Swap ``module``'s own floating-point parameters for casts to ``param_dtype`` for this
    forward call; returns (name, master, cast) to swap back. A parameter a vescale hook already
    swapped for its gathered copy (ZeRO-3: cast before the gather) is in ``param_dtype`` already."""
    swapped = []
    for name, p in module._parameters.items():
        if p is None or not p.is_floating_point() or p.dtype == policy.param_dtype:
            continue
        cast = p.to(policy.param_dtype)  # autograd-tracked: the gradient goes back to the master
        module._parameters[name] = cast
        swapped.append((name, p, cast))
    return swapped


class PolicyHooks:
    """The policy's hooks on one model: ``install_casts`` (pre-hooks: each module's own parameters
    cast, the root's inputs cast) and ``install_restores`` (forward hooks: the masters put back,
    the root's outputs cast). ``parallelize`` installs the casts after the plan's hooks (so a
    module's cast sees what they left there: a ZeRO-3 gathered copy is in ``param_dtype`` already)
    and the restores after every other forward hook (Static Eager's own restore puts back the
    tensor its pre-hook found, the cast, before the master can be)."""

    def __init__(self, model: nn.Module, policy: MixedPrecision):
        self.model, self.policy = model, policy
        # module -> the swaps of its forward calls in flight (a module may call itself)
        self.live: dict[nn.Module, list] = {}
        self.modules = [m for m in model.modules() if policy.param_dtype is not None
                        and any(p is not None and p.is_floating_point() for p in m._parameters.values())]

    def install_casts(self) -> list:
        policy, handles = self.policy, []
        for mod in self.modules:
            handles.append(mod.register_forward_pre_hook(self._cast))
        if policy.param_dtype is not None and policy.cast_forward_inputs:
            handles.append(self.model.register_forward_pre_hook(
                lambda m, args, kwargs: (_cast_floats(args, policy.param_dtype), _cast_floats(kwargs, policy.param_dtype)),
                with_kwargs=True))
        return handles

    def install_restores(self) -> list:
        handles = [mod.register_forward_hook(self._restore, always_call=True) for mod in self.modules]
        if self.policy.output_dtype is not None:
            dtype = self.policy.output_dtype
            handles.append(self.model.register_forward_hook(lambda m, args, out: _cast_floats(out, dtype)))
        return handles

    def _cast(self, mod: nn.Module, args) -> None:
        self.live.setdefault(mod, []).append(_cast_parameters(mod, self.policy))

    def _restore(self, mod: nn.Module, args, output) -> None:
        calls = self.live.get(mod)
        for name, master, casted in calls.pop() if calls else ():
            if mod._parameters.get(name) is casted:  # a vescale hook may have put the master back already
                mod._parameters[name] = master


def install_mixed_precision(model: nn.Module, policy: MixedPrecision) -> list:
    """All of the policy's hooks on ``model`` (``PolicyHooks``); returns the handles."""
    hooks = PolicyHooks(model, policy)
    return hooks.install_casts() + hooks.install_restores()


def apply_mixed_precision(model: nn.Module, policy: MixedPrecision) -> nn.Module:
    """Apply ``policy`` to a plain (single-device) ``model`` in place and return it: the reference
    run a parallel run with ``parallelize(..., mixed_precision=policy)`` matches.

    Each module's forward sees its floating-point parameters cast to ``policy.param_dtype`` (the
    cast is autograd-tracked, so ``param.grad`` arrives in the parameter's own dtype, summed in it
    over the uses); the root's floating-point inputs are cast to ``param_dtype`` and its outputs to
    ``output_dtype``. On one device there is no reduction, so ``reduce_dtype`` has no effect.
    Parameters and optimizer state keep their dtype (build the model in fp32)."""
    if state_of(model).ir is not None:
        raise ValueError(
            "apply_mixed_precision is for a plain model; pass mixed_precision= to vescale.parallelize instead"
        )
    if state_of(model).mixed_precision is not None:
        raise ValueError("apply_mixed_precision: the model already has a mixed-precision policy")
    state = state_of(model)
    state.mixed_precision, state.mixed_precision_handles = policy, install_mixed_precision(model, policy)
    return model
