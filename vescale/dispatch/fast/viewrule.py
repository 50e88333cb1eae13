"""PyTorch's view sharding rule, with the unflatten of a dim split by several mesh dims corrected.

Attention flattens (batch, heads) into one dim for its batched matmuls: ``torch.matmul`` on 4-D q
and k reshapes them to ``(batch * heads, seq, head_dim)``, runs ``bmm`` and views the scores back to
``(batch, heads, seq, seq)``. Under DP x TP, batch is ``Shard(0)`` on DP and heads ``Shard(1)`` on
TP; PyTorch's view rule flattens that into ``Shard(0)`` on DP and ``_StridedShard(0, sf)`` on TP,
whose split factor ``sf`` is the batch rows each DP rank holds. Unflattening back must put the TP
split on the heads dim. PyTorch 2.13's rule (``_ViewShardingPropagator._find_shard_for_split``)
looks for the placement that lands on each output dim of the split in mesh order and takes the
first *plain* ``Shard`` of the input dim for every split id: the DP ``Shard(0)`` shadows the TP
``_StridedShard`` for the heads dim, so the TP split is only kept where it happens to fit the
*batch* dim too (global batch divisible by TP). Otherwise the strict ``view`` / ``_unsafe_view``
raise ("This operation would remove or reshape sharded dimension 0"), and a ``reshape`` gathers the
heads: one sequence per DP rank with a global batch smaller than TP (the usual long-context set-up)
crashed in the first forward.

A plain ``Shard`` always lands on the first output dim of a split (PyTorch's rewrite phase says
so); only a ``_StridedShard`` whose split factor matches can land on a later one. ``_Propagator``
hides the plain shards of the split dim from that search for later split ids and is PyTorch's
propagator otherwise; its rewrite phase (PyTorch's) then puts the TP split on the heads dim.

Every decision is then checked (``_wrong_mesh_dims``): each mesh dim's rank coordinate picks digits
of the flat (row-major) index, in the input's target layout and in the output's; where they differ
the output layout is not the input's viewed, and those mesh dims are gathered first (a strict view
raises). PyTorch's rule gets a few of those wrong silently: ``(1, 6)`` with ``_StridedShard(1, 3)``
on 2 ranks viewed as ``(1, 2, 3)`` keeps ``_StridedShard(2, 3)`` (each rank holds every other
element, which no layout of the last dim of 3 describes); ``(4,)`` split over 2 x 2 ranks viewed as
``(2, 2)`` puts both mesh dims on the first dim of 2.

``install_view_rule`` puts this in front of PyTorch's strategies for ``view``, ``_unsafe_view``,
``view_copy`` and ``reshape`` through the propagator's strategy table: where the corrected decision
is PyTorch's, PyTorch's strategy function answers unchanged; ``viewkey`` asks it too.
``tests/dispatch/test_view_rule.py`` checks its decisions against the local shards of random
reshapes (any mesh, any placements), not against PyTorch's rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor
from vescale._torch import (
    DTensorSpec, OpSchema, OpSpec, OpStrategy, _ViewShardingPropagator, dim_maps,
    propagate_shape_and_sharding, generate_redistribute_costs, _StridedShard, PATCHES,
)
from torch.distributed.tensor.placement_types import Replicate, Shard

if TYPE_CHECKING:
    from torch.distributed.tensor.placement_types import Placement

__all__ = ["propagate_view", "install_view_rule", "uninstall_view_rule", "VIEW_OPS"]

aten = torch.ops.aten
# op -> (the function whose dim_maps rule PyTorch uses, strict view)
VIEW_OPS = {
    aten.view.default: (torch.Tensor.view, True),
    aten._unsafe_view.default: (torch.Tensor.view, True),
    aten.view_copy.default: (torch.Tensor.view, False),
    aten.reshape.default: (torch.reshape, False),
}
_OWNER = "dispatch.fast.viewrule"


class _Propagator(_ViewShardingPropagator):
    """PyTorch's propagator; for split ids after the first, a plain ``Shard`` of the split input dim
    is not a candidate (it lands on the first output dim), so a ``_StridedShard`` on a later mesh
    dim is found."""

    def _find_shard_for_split(self, current_dim, cmd, placements):
        if not cmd.split_id:
            return super()._find_shard_for_split(current_dim, cmd, placements)
        matched = self.matched_strided_mesh_dims
        plain = {m for m, p in enumerate(placements) if type(p) is Shard and p.dim == current_dim}
        self.matched_strided_mesh_dims = matched | plain  # PyTorch's own way to skip a mesh dim
        try:
            return super()._find_shard_for_split(current_dim, cmd, placements)
        finally:
            self.matched_strided_mesh_dims = matched


def _has_strided(placements) -> bool:
    return any(isinstance(p, _StridedShard) for p in placements)


def _take(digits: list, k: int):
    """Split the most significant radix-``k`` digit off a mixed-radix index ``digits`` (``[(radix,
    global place)]``, most significant first): ``(taken, rest)``, or None where ``k`` does not
    factor the leading radixes (an uneven cut)."""
    taken, rest = [], list(digits)
    while k > 1:
        if not rest:
            return None
        r, g = rest.pop(0)
        if r % k == 0:
            taken.append((k, g * r // k))
            if r > k:
                rest.insert(0, (r // k, g))
            k = 1
        elif k % r == 0:
            taken.append((r, g))
            k //= r
        else:
            return None
    return taken, rest


def _rank_digits(shape, placements, mesh_sizes) -> list | None:
    """Per mesh dim, the digits of the flat (row-major) index that its rank coordinate picks,
    merged where adjacent: two layouts whose rank digits agree give every rank the same elements in
    the same order, so the local tensor of one is a view of the other's. None where a cut is uneven
    (the digits do not exist)."""
    local = {d: [(n, 1)] for d, n in enumerate(shape)}  # each dim's local index, as global digits
    picked: list = [[] for _ in mesh_sizes]
    for m, (p, size) in enumerate(zip(placements, mesh_sizes)):
        if size == 1 or not isinstance(p, (Shard, _StridedShard)):
            continue
        sf = p.split_factor if isinstance(p, _StridedShard) else 1
        top = _take(local[p.dim], sf)  # a _StridedShard keeps its sf pieces, cutting below them
        cut = top and _take(top[1], size)
        if cut is None:
            return None
        local[p.dim] = top[0] + cut[1]
        place = math.prod(shape[p.dim + 1:])
        picked[m] = [(r, g * place) for r, g in cut[0]]
    merged = []
    for digits in picked:
        out: list = []
        for r, g in sorted(digits, key=lambda d: -d[1]):
            if out and out[-1][1] == g * r:
                out[-1] = (out[-1][0] * r, g)
            else:
                out.append((r, g))
        merged.append(out)
    return merged


def _wrong_mesh_dims(shape, target, out_shape, out, mesh_sizes) -> list:
    """The mesh dims on which the decision's output layout is not the input's viewed (empty where
    right, or where the input's own cut is uneven and cannot be checked this way)."""
    have = _rank_digits(shape, target, mesh_sizes)
    if have is None:
        return []
    want = _rank_digits(out_shape, out, mesh_sizes)
    if want is None:
        return [m for m, p in enumerate(out) if isinstance(p, (Shard, _StridedShard)) and mesh_sizes[m] > 1]
    return [m for m in range(len(mesh_sizes)) if have[m] != want[m]]


def _output_shape(shape, rule) -> tuple:
    from vescale._torch import InputDim

    out = []
    for cmd in rule:
        if isinstance(cmd, InputDim):
            out.append(shape[cmd.input_dim])
        elif hasattr(cmd, "group_shape"):  # Split
            out.append(cmd.group_shape[cmd.split_id])
        elif hasattr(cmd, "input_dims"):  # Flatten
            out.append(math.prod(shape[d.input_dim] for d in cmd.input_dims))
        else:  # Singleton, Broadcast, ...
            out.append(1)
    return tuple(out)


def propagate_view(placements: Sequence[Placement], shape: Sequence[int], rule: Sequence[Any], mesh_sizes: Sequence[int],
                   strict: bool) -> tuple[Sequence[Placement], Sequence[Placement]]:
    """``propagate_shape_and_sharding`` (input target placements, output placements), corrected:
    for inputs with a ``_StridedShard``, the split found for later split ids; for any input, a
    decision whose output layout is not the input's viewed (PyTorch keeps a ``_StridedShard`` on an
    output dim whose size does not fit it, or several mesh dims on a first split dim too short for
    them) gathers those mesh dims first instead (a strict view raises, as PyTorch does for a view
    it cannot make local). Inputs cut unevenly are PyTorch's alone (the check needs even cuts).

    A shard on a mesh dim of one rank holds the whole dim: it is decided as ``Replicate`` (PyTorch's
    strict rule refuses to reshape a dim "sharded" over one rank), the input taken as it is and the
    output replicated on that mesh dim."""
    unit = [m for m, (p, n) in enumerate(zip(placements, mesh_sizes)) if n == 1 and isinstance(p, (Shard, _StridedShard))]
    if unit:
        whole = [Replicate() if m in unit else p for m, p in enumerate(placements)]
        target, out = propagate_view(whole, shape, rule, mesh_sizes, strict)
        return [placements[m] if m in unit else t for m, t in enumerate(target)], out
    if _has_strided(placements):
        propagator = _Propagator(placements, shape, rule, mesh_sizes, strict)
        target, to_output = propagator.analyze()
        out = propagator.rewrite_output_placements(target, to_output)
    else:
        target, out = propagate_shape_and_sharding(placements, shape, rule, mesh_sizes, strict)
    wrong = _wrong_mesh_dims(shape, target, _output_shape(shape, rule), out, mesh_sizes)
    if not wrong:
        return target, out
    if strict:
        raise RuntimeError(
            f"Cannot unflatten unevenly sharded tensor: the shards of mesh dim(s) {wrong} do not stay "
            f"contiguous pieces of the output. Please redistribute the tensor before this operation.")
    gathered = [Replicate() if m in wrong else p for m, p in enumerate(target)]
    target, out = propagate_view(gathered, shape, rule, mesh_sizes, strict)
    return list(target), out


def _pytorchs(placements, shape, rule, mesh_sizes, strict):
    try:
        target, out = propagate_shape_and_sharding(placements, shape, rule, mesh_sizes, strict)
    except Exception:
        return None
    return list(target), list(out)


def _strategy(op, original):
    fn, strict = VIEW_OPS[op]

    def strategy(op_schema: OpSchema) -> OpStrategy:
        inputs = op_schema.args_schema[0]
        if not isinstance(inputs, OpStrategy):
            return original(op_schema)
        rule = dim_maps[fn](*op_schema.args_schema, **op_schema.kwargs_schema)
        mesh = op_schema.get_mesh_from_args(validate=False)
        shape = tuple(inputs.shape)
        decided = [propagate_view(c.output_spec.placements, shape, rule, mesh.shape, strict) for c in inputs.strategies]
        if all((list(t), list(o)) == _pytorchs(c.output_spec.placements, shape, rule, mesh.shape, strict)
               for (t, o), c in zip(decided, inputs.strategies)):
            return original(op_schema)  # PyTorch's decision stands: its own strategy, as it builds it
        # PyTorch's reshape_strategy with the corrected decisions
        found = OpStrategy([])
        for (target, out), candidate in zip(decided, inputs.strategies):
            target_spec = DTensorSpec(mesh, tuple(target), tensor_meta=candidate.output_spec.tensor_meta,
                                      use_strided_shard_as_shard_order=False)
            found.strategies.append(OpSpec(
                output_specs=DTensorSpec(mesh, tuple(out), use_strided_shard_as_shard_order=False),
                input_specs=(target_spec,),
                redistribute_cost=[generate_redistribute_costs(inputs, target_spec)],
            ))
        return found

    strategy.__wrapped__ = original
    return strategy


def install_view_rule() -> None:
    """Put the corrected rule in front of PyTorch's view strategies (idempotent)."""
    table = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    if PATCHES.owners(_OWNER):
        return
    for op in VIEW_OPS:
        if op in table:
            PATCHES.set_item(_OWNER, table, op, _strategy(op, table[op]), f"DTensor strategy {op}")


def uninstall_view_rule() -> None:
    PATCHES.undo(_OWNER)


