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
layouts the relabels give (``relabelled_move``): the sub-mesh side's placements with the DP
placement put back. Those moves are the plan's redistribution on the other dims, and the DP dim
stays as it was: nothing moves there. Its parameters get their full-mesh gradient layouts
(``grad_placements``: ``Partial`` on DP, as the scope's parameter views hand them back), and the
scope's hooks are bypassed for the step (``Scope.bypass``). In a record derived for new input sizes
the moves are compiled at their first call (``LazyRelabel``). The local tensors, their values and
the collectives are those of the eager path; ``tests/static/test_static_moe.py`` compares both bit
for bit.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Literal

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from vescale._torch import DTensorSpec, TensorMeta

from ..dispatch.metas import contiguous_strides
from ..parallel.batch_local import _with  # the placements with DP's put back, as the scope's hooks do
from ..parallel.placing import grad_layout
from .resize import LazyMove, ResizeMismatch, settle

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from ..parallel.batch_local import Scope
    from .boundary import Move
    from .record import Crossing

__all__ = ["relabelled_move", "LazyRelabel", "grad_placements"]


def relabelled_move(
    a: Crossing, b: Crossing, scope: Scope, side: str, make_move: Callable[[Crossing, Crossing], Move]
) -> Move | LazyRelabel | Literal[False] | None:
    """The move at batch-local ``scope``'s boundary between crossings ``a`` and ``b`` with its
    sub-mesh side on the full mesh: ``b`` (the body's input) for ``side="in"``, ``a`` (the body's
    output) for ``side="out"``; ``make_move(a, b)`` makes it from (stand-in) crossings. None for a
    plain tensor passing through; a ``LazyRelabel`` where sizes are still open (a derived record);
    False where no relabel stands for the scope's hooks (a plain tensor on one side only, a
    gradient layout stated by the plan, other sizes than the batch's share)."""
    full, sub = (a, b) if side == "in" else (b, a)
    full_spec, sub_spec = _recorded(full), _recorded(sub)
    if full_spec is None and sub_spec is None:
        return None  # a plain tensor passes through the scope's hooks as it is
    if full_spec is None or sub_spec is None or full_spec.mesh != scope.mesh or sub_spec.mesh != scope.sub:
        return False
    label = None if sub.leave_grad is not None else _label(full_spec, sub_spec, sub.grad_placements, scope, side)
    if label is None:
        return False
    if a.pending is not None or b.pending is not None:
        return LazyRelabel(a, b, scope, side, label, make_move)
    pair = _stand_ins(a, b, label, scope, side)
    return False if pair is None else make_move(*pair)


def _recorded(c):
    """A crossing's spec; in a derived record whose sizes are open, the recorded one's (its
    placements and meshes are the same at any size)."""
    return c.pending.spec if c.pending is not None else c.spec


def _label(full: DTensorSpec, sub: DTensorSpec, sub_grad, scope, side: str) -> tuple | None:
    """The stand-in's placements and gradient placements: the sub-mesh side's, with DP's put back
    (None: the two sides are not one tensor relabelled)."""
    dp, dim = scope.dp, scope.dim
    shape, sub_shape = full.shape, sub.shape
    if len(shape) != len(sub_shape) or any(x != y for d, (x, y) in enumerate(zip(shape, sub_shape)) if d != dim):
        return None
    if side == "out":  # the scope's output leaves as this rank's tokens (its gradient too: the default)
        return _with(sub.placements, dp, Shard(dim)), None
    # Split on DP after the plan's hook: the body got this rank's share; else the whole batch.
    on_dp = Shard(dim) if sub_shape[dim] != shape[dim] else Replicate()
    if on_dp.is_replicate() and not full.placements[dp].is_replicate():
        return None
    grad_dp = Shard(dim) if on_dp.is_shard() else Partial()  # each rank's tokens' share of the sum
    return _with(sub.placements, dp, on_dp), _with(sub_grad or grad_layout(sub.placements), dp, grad_dp)


def _stand_ins(a, b, label: tuple, scope, side: str):
    """``(a, b)``, their full-mesh side settled, with the sub-mesh side's stand-in (None: the sizes
    do not fit the relabel)."""
    placements, grad = label
    if side == "in":
        spec = _spec(scope, placements, a.spec.shape, a.spec)
        return a, dataclasses.replace(b, spec=spec, grad_placements=grad, pending=None)
    whole = _whole(a.spec.shape, scope)
    if tuple(b.spec.shape) != whole:
        return None
    return dataclasses.replace(a, spec=_spec(scope, placements, whole, a.spec), pending=None), b


def _whole(share, scope) -> tuple:
    """The global shape of a scope's output whose rank holds ``share`` (every DP rank as many tokens,
    as the scope's own hook has it)."""
    whole = list(share)
    whole[scope.dim] *= scope.mesh.size(scope.dp)
    return tuple(whole)


def _spec(scope, placements: tuple, shape, like: DTensorSpec) -> DTensorSpec:
    meta = TensorMeta(torch.Size(shape), contiguous_strides(tuple(shape)), like.tensor_meta.dtype)
    return DTensorSpec(scope.mesh, placements, tensor_meta=meta)


class LazyRelabel(LazyMove):
    """A derived record's relabelled move (``resize.LazyMove``'s role), compiled at its first call:
    the crossing the tensor crosses at settles from it (the full-mesh one going in, the sub-mesh one
    coming out), the full-mesh result coming out from that share."""

    def __init__(self, a, b, scope, side: str, label: tuple, make_move):
        super().__init__(a, b, make_move)
        self.scope, self.side, self.label = scope, side, label

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.move is None:
            a, b = self.src, self.dst
            if a.pending is not None:
                settle(a, t)
            if self.side == "out" and b.pending is not None:
                b.spec, b.pending = b.pending.settle_global(_whole(a.spec.shape, self.scope)), None
            pair = _stand_ins(a, b, self.label, self.scope, self.side)
            if pair is None:
                raise ResizeMismatch(f"batch-local {self.scope.path!r}: its output at the new sizes is not its ranks' shares")
            self.move = self.make_move(*pair)
        return self.move(t)


def grad_placements(recorded: tuple | None, param: DTensor, scope: Scope) -> tuple:
    """The gradient placements of ``param`` (gathered, on the full mesh) used inside ``scope``: as
    recorded on the sub-mesh (the default layout if none arrived), ``Partial`` on DP (each rank's
    sum over its own tokens)."""
    dp = scope.dp
    if recorded is None:
        recorded = grad_layout(tuple(p for i, p in enumerate(param.placements) if i != dp))
    return _with(tuple(recorded), dp, Partial())
