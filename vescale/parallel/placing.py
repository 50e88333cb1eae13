"""Putting a tensor into planned placements, whatever it is now.

A plain ``torch.Tensor`` met by vescale is taken for what it is in the single-device program: the
whole (global) tensor, identical on every rank. It becomes a Replicate DTensor and is then
redistributed, so ``Replicate -> Shard`` costs a local slice and no communication. A DTensor is
redistributed only along the mesh dimensions the plan names (``None`` = leave as is).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from vescale._torch import DTensorSpec, _is_shard_like


from ..comm import moves
from ..placement import InterleavedShard, interleave_of, is_interleaved
from ..plan.ir import PlanError

if TYPE_CHECKING:
    from ..plan.ir import Entry

__all__ = ["as_dtensor", "place", "place_entry", "grad_layout", "relabel", "moves_nothing"]


def as_dtensor(t: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """A plain tensor, taken as the global tensor held identically on every rank, as a DTensor."""
    if isinstance(t, DTensor):
        return t
    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)


def place(t: object, mesh: DeviceMesh, targets: Sequence[Optional[Placement]], what: str) -> DTensor:
    """Redistribute ``t`` to ``targets`` (one entry per mesh dim; None keeps the current one)."""
    if not isinstance(t, torch.Tensor):
        raise PlanError(f"{what}: the plan places a tensor here, but the value is a {type(t).__name__}")
    if isinstance(t, DTensor) and t.device_mesh != mesh:
        raise PlanError(f"{what}: tensor lives on mesh {t.device_mesh}, the plan's mesh is {mesh}")
    d = as_dtensor(t, mesh)
    want = tuple(cur if tgt is None else tgt for cur, tgt in zip(d.placements, targets))
    for p in want:
        if _is_shard_like(p) and not -d.ndim <= p.dim < d.ndim:
            raise PlanError(
                f"{what}: {f'Shard({p.dim})' if isinstance(p, Shard) else repr(p)} does not fit a tensor of shape {tuple(d.shape)}; "
                f"use a dim in [0, {d.ndim})"
            )
        if is_interleaved(p) and d.shape[p.dim] % interleave_of(p):
            raise PlanError(
                f"{what}: {p!r} needs dim {p.dim} of a tensor of shape {tuple(d.shape)} to split into "
                f"{interleave_of(p)} equal sections"
            )
    # Negative dims counted from the end, as DTensor's layouts hold them (Shard(-1) is Shard(ndim - 1)).
    want = tuple(_counted_from_start(p, d.ndim) for p in want)
    if want == tuple(d.placements):
        return d
    if moves_nothing(mesh, d.placements, want):
        return relabel(d, want)
    return moves.redistribute(d, want)  # DTensor's redistribute, with its moves compiled once


def _counted_from_start(p: Placement, ndim: int) -> Placement:
    if is_interleaved(p):
        return InterleavedShard(p.dim % ndim, interleave_of(p))
    if type(p) is Shard and p.dim < 0:
        return Shard(p.dim % ndim)
    return p


def moves_nothing(mesh: DeviceMesh, src: Sequence[Placement], dst: Sequence[Placement]) -> bool:
    """Whether ``src`` and ``dst`` differ only on mesh dims of one rank. There every placement holds
    the same local tensor (a Partial over one rank is its own sum, a Shard the whole dim), so going
    from one to the other moves no data: the batch split over a DP of 1 (a ``(1, TP)`` mesh), or a
    loss averaged over it."""
    return all(a == b or mesh.size(i) == 1 for i, (a, b) in enumerate(zip(src, dst)))


def relabel(d: DTensor, placements: tuple) -> DTensor:
    """``d`` laid out as ``placements`` where ``moves_nothing`` holds: the same local tensor under
    the new placements, with ``redistribute``'s gradient. DTensor's own ``redistribute`` gets the same
    result through its planner and, for a Partial, a collective over the one rank, forward and
    backward: about 0.15 ms a call on the CPU, which a static step pays for each root input and
    its loss."""
    return _Relabel.apply(d, tuple(placements))


class _Relabel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: DTensor, placements: tuple) -> DTensor:
        ctx.src = x._spec
        local = x._local_tensor
        spec = DTensorSpec(x.device_mesh, placements, tensor_meta=x._spec.tensor_meta)
        return DTensor(local.view_as(local), spec, requires_grad=x.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor, None]:
        # What Redistribute's backward hands back: the source placements, except that a Partial
        # source takes a gradient that arrives Shard or Replicate as Replicate.
        src, mesh = ctx.src, ctx.src.mesh
        want = moves.grad_placements(grad.placements, src.placements)
        if tuple(grad.placements) == want:
            return grad, None
        if not moves_nothing(mesh, grad.placements, want):
            return grad.redistribute(mesh, want), None
        spec = DTensorSpec(mesh, want, tensor_meta=grad._spec.tensor_meta)
        return DTensor(grad._local_tensor, spec, requires_grad=False), None


# ---------------------------------------------------------------------------------------------
# plan.redistribute / plan.annotate on activations
# ---------------------------------------------------------------------------------------------


def grad_layout(placements: tuple) -> tuple:
    """The gradient placements DTensor hands back through ``redistribute`` and ``from_local`` by
    default: the forward placements with Partial as Replicate."""
    return tuple(Replicate() if p.is_partial() else p for p in placements)


def _fmt(placements) -> str:
    from ..plan.api import placement_str

    return "[" + ", ".join("-" if p is None else placement_str(p) for p in placements) + "]"


def _arrives_as(t: torch.Tensor, mesh: DeviceMesh) -> tuple:
    """How a tensor at a hook is laid out: a plain tensor is the global tensor, i.e. Replicate."""
    if not isinstance(t, DTensor):
        return (Replicate(),) * mesh.ndim
    return tuple(Shard(p.dim % t.ndim) if type(p) is Shard else p for p in t.placements)


def agrees(stated: Placement | None, have: Placement) -> bool:
    """Whether placement ``have`` is what a statement's ``stated`` placement says (None: anything).
    A stated Partial matches any Partial with its reduce op, e.g. the masked Partial of a
    vocabulary-parallel embedding's output, which DTensor keeps as a Partial subclass."""
    if stated is None:
        return True
    if stated.is_partial():
        return have.is_partial() and have.reduce_op == stated.reduce_op
    return stated == have


def _statements(e) -> str:
    return "plan statement(s) #" + ", #".join(map(str, e.statements))


def place_entry(t: object, mesh: DeviceMesh, e: Entry, what: str) -> torch.Tensor:
    """Apply one activation entry of the Plan IR (``plan.shard``, ``plan.redistribute`` or
    ``plan.annotate``) to ``t``."""
    if not isinstance(t, torch.Tensor):
        raise PlanError(f"{what}: the plan places a tensor here, but the value is a {type(t).__name__}")
    if e.action == "annotate":
        return _annotated(t, mesh, e, what)
    if e.sources is not None:
        have = _arrives_as(t, mesh)
        if not all(agrees(s, h) for s, h in zip(e.sources, have)):
            hint = "; a plain tensor arrives as Replicate: plan.annotate it first if it is a local shard" if not isinstance(t, DTensor) else ""
            raise PlanError(
                f"{what}: {_statements(e)} redistribute(s) it from {_fmt(e.sources)} but it arrives as "
                f"{_fmt(have)}; fix the source placements (vescale.static.export_plan prints the recorded ones){hint}"
            )
    if e.grad_sources is None and e.grad_targets is None:
        placed = place(t, mesh, e.targets, what)
        if placed is t and t.requires_grad and torch.is_grad_enabled():
            # Nothing moves, yet the gradient leaves laid out like the value, as a move's does: a
            # Partial gradient is reduced here (Megatron's ``f``), not wherever it next meets another
            # layout. Static Eager's boundary does the same (it cannot defer a reduction into local
            # code), so both modes reduce at the same spot and compute the same bits.
            return relabel(placed, tuple(placed.placements))
        return placed
    d = as_dtensor(t, mesh)
    dst = tuple(cur if tgt is None else tgt for cur, tgt in zip(d.placements, e.targets))
    default = grad_layout(d.placements)
    grad_dst = tuple(g if g is not None else p for g, p in zip(e.grad_targets or (None,) * mesh.ndim, default))
    return _RedistributeWithGrad.apply(d, dst, e.grad_sources, grad_dst)


def _annotated(t: torch.Tensor, mesh: DeviceMesh, e, what: str) -> DTensor:
    if isinstance(t, DTensor):
        have = _arrives_as(t, mesh)
        if not all(agrees(a, h) for a, h in zip(e.targets, have)):
            raise PlanError(
                f"{what}: {_statements(e)} annotate(s) it as {_fmt(e.targets)} but it is a DTensor laid out as "
                f"{_fmt(have)}; fix the annotation (vescale.static.export_plan prints the recorded placements)"
            )
        return t
    # A plain tensor here is this rank's local shard, laid out as annotated (even shards).
    placements = tuple(Replicate() if p is None else p for p in e.targets)
    for p in placements:
        if _is_shard_like(p) and not -t.ndim <= p.dim < t.ndim:
            raise PlanError(f"{what}: {_statements(e)} annotate(s) {_fmt(e.targets)}, which does not fit a tensor of shape {tuple(t.shape)}")
    return DTensor.from_local(t, mesh, placements, run_check=False)


class _RedistributeWithGrad(torch.autograd.Function):
    """``redistribute`` whose gradient is first moved to ``grad_src`` (where stated) and then to
    ``grad_dst``, not to DTensor's default."""

    @staticmethod
    def forward(ctx: Any, x: DTensor, dst: tuple, grad_src: tuple | None, grad_dst: tuple) -> DTensor:
        ctx.mesh, ctx.grad_src, ctx.grad_dst = x.device_mesh, grad_src, grad_dst
        return x.redistribute(x.device_mesh, dst)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor, None, None, None]:
        if ctx.grad_src is not None:
            arrived = tuple(grad.placements)
            want = tuple(a if s is None else s for a, s in zip(arrived, ctx.grad_src))
            if not all(agrees(w, a) for w, a in zip(want, arrived)):
                grad = grad.redistribute(ctx.mesh, want)
        if tuple(grad.placements) != ctx.grad_dst:
            grad = grad.redistribute(ctx.mesh, ctx.grad_dst)
        return grad, None, None, None
