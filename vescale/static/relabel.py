"""Batch-local modules in Static Eager steps: their hooks' DTensor conversions as precompiled relabels.

A ``plan.batch_local`` module (``vescale.parallel.batch_local``) runs on this DP rank's tokens: its
hooks turn each full-mesh input that is ``Shard(0)`` on DP into a DTensor on the sub-mesh of the
other dims, each parameter (gathered, ``Replicate`` on DP) into one whose gradient goes back
``Partial`` over DP, and each output back to the full mesh. On local tensors all of that is the
identity: only labels change. Eagerly that is right; between static modules it costs a wrap into a
DTensor, the scope's conversions, the plan's redistribution through DTensor and an unwrap at every
call, forward and backward, plus the parameter hooks of every module inside.

So a record whose scope runs static with a static caller, everything inside it static too, moves
the scope's inputs and outputs with precompiled moves (``boundary.Move``) between the full-mesh
layouts the relabels give (``relabelled``): the sub-mesh side's placements with the DP placement
put back. Those moves are the plan's redistribution on the other dims, and the DP dim stays as it
was: nothing moves there. Its parameters get their full-mesh gradient layouts
(``grad_placements``: ``Partial`` on DP, as the scope's parameter views hand them back), and the
scope's hooks are bypassed for the step (``Scope.bypass``). The local tensors, their values and the
collectives are those of the eager path; ``tests/static/test_static_moe.py`` compares both bit for
bit.
"""

from __future__ import annotations

import dataclasses

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..dispatch.metas import contiguous_strides
from ..parallel.placing import grad_layout

__all__ = ["relabelled", "grad_placements"]


def _with(placements: tuple, i: int, p) -> tuple:
    out = list(placements)
    out.insert(i, p)
    return tuple(out)


def relabelled(a, b, scope, side: str):
    """The crossing pair ``(a, b)`` of a move at batch-local ``scope``'s boundary with its sub-mesh
    side on the full mesh: ``b`` (the body's input) for ``side="in"``, ``a`` (the body's output)
    for ``side="out"``. None where no relabel stands for the scope's hooks there (a plain tensor on
    one side, sizes still open in a derived record, a gradient layout stated by the plan)."""
    full, sub = (a, b) if side == "in" else (b, a)
    if full.spec is None and sub.spec is None:
        return a, b  # a plain tensor passes through the scope's hooks as it is
    if full.spec is None or sub.spec is None or full.spec.mesh != scope.mesh or sub.spec.mesh != scope.sub:
        return None
    if full.pending is not None or sub.pending is not None or sub.leave_grad is not None:
        return None
    dp, dim = scope.dp, scope.dim
    shape, sub_shape = list(full.spec.shape), list(sub.spec.shape)
    if len(shape) != len(sub_shape) or any(x != y for d, (x, y) in enumerate(zip(shape, sub_shape)) if d != dim):
        return None
    if side == "in":
        # Split on DP after the plan's hook: the body got this rank's share; else the whole batch.
        on_dp = Shard(dim) if sub_shape[dim] != shape[dim] else Replicate()
        if on_dp.is_replicate() and not full.spec.placements[dp].is_replicate():
            return None
        grad_dp = Shard(dim) if on_dp.is_shard() else Partial()  # each rank's tokens' share of the sum
        grad = _with(sub.grad_placements or grad_layout(sub.spec.placements), dp, grad_dp)
        spec = _spec(scope, _with(sub.spec.placements, dp, on_dp), full.spec)
        return a, dataclasses.replace(b, spec=spec, grad_placements=grad)
    spec = _spec(scope, _with(sub.spec.placements, dp, Shard(dim)), full.spec)
    return dataclasses.replace(a, spec=spec), b


def _spec(scope, placements: tuple, full: DTensorSpec) -> DTensorSpec:
    meta = TensorMeta(full.shape, contiguous_strides(full.shape), full.tensor_meta.dtype)
    return DTensorSpec(scope.mesh, placements, tensor_meta=meta)


def grad_placements(recorded: tuple | None, param, scope) -> tuple:
    """The gradient placements of ``param`` (gathered, on the full mesh) used inside ``scope``: as
    recorded on the sub-mesh (the default layout if none arrived), ``Partial`` on DP (each rank's
    sum over its own tokens)."""
    dp = scope.dp
    if recorded is None:
        recorded = grad_layout(tuple(p for i, p in enumerate(param.placements) if i != dp))
    return _with(tuple(recorded), dp, Partial())
