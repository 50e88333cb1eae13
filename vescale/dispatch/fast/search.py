"""Cheap sharding-propagation misses on N-D meshes: the paper's rule-based bypass for strategy search.

On a cache miss (a new op, placement or shape), PyTorch 2.13 expands an op's single-mesh-dim
strategies to every combination over the mesh and prices each one with the redistribute planner's
graph search. On a 2-D mesh one batched matmul costs seconds that way (the first DP x TP step of the
zoo LLaMA spent 14.7 s there), although in almost every case the inputs already sit in a valid
strategy and nothing needs to move.

PyTorch ships the cheaper search too (``_dijkstra_expand_single_dim_strategy_to_mesh``): first it
asks whether the current input placements match a single-dim rule on every mesh dimension (then
the answer is that rule, with no redistribution and no cost computation), otherwise it walks a
priority queue over one-placement changes. It is not wired into the default path in 2.13. This
module registers it, through the propagator's own ``register_op_strategy`` extension point, for
every op that has a single-dim strategy; the full expansion stays the fallback wherever the search
declines and the inputs match no rule as they are (tensor lists, foreach ops, ``_StridedShard``
inputs that need to move).

Only the search changes. Any strategy it returns is a valid one of the op's own rules, so results
are what DTensor computes; PyTorch's caches and C++ fast path for hits are untouched. In-place and
``out=`` ops never take the priority-queue search, which does not know that their result must keep
its tensor's placements: they take a match of the inputs as they are that does, or the full
expansion (whose filter does).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor
from vescale._torch import (
    OpSchema, OpStrategy, TupleStrategy, _is_shard_like, _dijkstra_expand_single_dim_strategy_to_mesh,
    _expand_single_dim_strategy_to_mesh, _PreparedSingleDimStrategy, PATCHES,
)
from ..metas import meta_outputs, miss_outputs

__all__ = ["install_fast_search", "uninstall_fast_search"]

_OWNER = "dispatch.fast.search"


def _propagator():
    return DTensor._op_dispatcher.sharding_propagator


def _specs_schema(strategy_schema: OpSchema) -> OpSchema:
    """The OpSchema of DTensorSpecs that a strategy schema (OpStrategy per tensor) was made from."""

    def spec(a: Any) -> Any:
        if isinstance(a, OpStrategy):
            return a.strategies[0].output_spec
        if isinstance(a, TupleStrategy):
            return [spec(c) for c in a.children]
        return a

    return OpSchema(
        strategy_schema.op,
        tuple(spec(a) for a in strategy_schema.args_schema),
        {k: spec(v) for k, v in strategy_schema.kwargs_schema.items()},
        schema_info=strategy_schema.schema_info,
    )


def _zero_cost_match(mesh, strategy_schema: OpSchema, info, out_meta):
    """The rule matching the inputs as they are, on every mesh dim (no redistribution), or None.

    The priority-queue search declines ``_StridedShard`` inputs because its cost model does not
    price them; a plain match needs no prices. This is the case of attention matmuls on a DP x TP
    mesh, whose flattened (batch x heads) dim is ``(Shard(0), _StridedShard(0))`` on both sides."""
    if any(isinstance(a, TupleStrategy) for a in strategy_schema.args_schema) or any(
        isinstance(v, (OpStrategy, TupleStrategy)) for v in strategy_schema.kwargs_schema.values()
    ):
        return None
    specs = [a.strategies[0].output_spec for a in strategy_schema.args_schema if isinstance(a, OpStrategy)]
    prepared = _PreparedSingleDimStrategy(info, strategy_schema, out_meta, num_inputs=len(specs))
    return prepared.try_propagate(mesh, tuple(s.placements for s in specs), specs)


def _slice_match(mesh, strategy_schema: OpSchema, info, out_meta):
    """The rule that matches every sharded input as it is, slicing Replicate inputs to what the rule
    wants (a local copy, no communication), or None.

    The priority-queue search declines ``_StridedShard`` inputs, and PyTorch's full expansion
    prices Replicate -> ``_StridedShard`` above gathering the sharded inputs. So an op that mixes a
    heads-split (batch x heads) tensor with a plain one — ``baddbmm(empty, q, k^T, beta=0)`` in
    diffusers' ``head_to_batch_dim`` attention, a mask made inside forward — gathered the heads and
    ran replicated."""
    if any(isinstance(a, TupleStrategy) for a in strategy_schema.args_schema) or any(
        isinstance(v, (OpStrategy, TupleStrategy)) for v in strategy_schema.kwargs_schema.values()
    ):
        return None
    specs = [a.strategies[0].output_spec for a in strategy_schema.args_schema if isinstance(a, OpStrategy)]
    if not any(s.placements[d].is_replicate() for s in specs for d in range(mesh.ndim)):
        return None  # nothing to slice: the exact match already failed
    prepared = _PreparedSingleDimStrategy(info, strategy_schema, out_meta, num_inputs=len(specs))
    chosen = []
    for d in range(mesh.ndim):
        have = tuple(s.placements[d] for s in specs)
        fits = [
            key for key in prepared.strategy_lookup
            if len(key) == len(have)
            and all(k == h or (h.is_replicate() and _is_shard_like(k)) for k, h in zip(key, have))
        ]
        if not fits:
            return None
        chosen.append(min(fits, key=lambda key: sum(k != h for k, h in zip(key, have))))  # slice the fewest
    placements = tuple(tuple(chosen[d][i] for d in range(mesh.ndim)) for i in range(len(specs)))
    return prepared.try_propagate(mesh, placements, specs)


def _keeps_placements(found: OpStrategy, strategy_schema: OpSchema) -> bool:
    """An in-place op writes into its first argument, an out= op into ``out``: the result must be
    laid out as that tensor already is."""
    spec = found.strategies[0].output_spec
    if strategy_schema.is_inplace_op():
        target = strategy_schema.args_schema[0]
    else:
        target = next((v for k, v in strategy_schema.kwargs_schema.items() if isinstance(v, OpStrategy)), None)
    return isinstance(target, OpStrategy) and spec.placements == target.strategies[0].output_spec.placements


def _searched(info):
    """An op-strategy function: PyTorch's priority-queue search over ``info``, full expansion as fallback."""

    def strategy(strategy_schema: OpSchema) -> OpStrategy | TupleStrategy:
        prop = _propagator()
        mesh = strategy_schema.get_mesh_from_args()
        # The caller has the output metadata but does not pass it on; recomputing it with meta-device
        # kernels costs far less than a second FakeTensor run (PyTorch's way, the fallback).
        specs = _specs_schema(strategy_schema)
        out_meta = miss_outputs(specs) or meta_outputs(specs)
        if out_meta is None:
            out_meta = prop._propagate_tensor_meta(specs)
        if strategy_schema.is_inplace_op() or strategy_schema.is_out_variant_op():
            # The priority-queue search ignores that an in-place (or out=) result must keep its
            # tensor's placements (it turned `param.add_(partial_grad)` into a Partial param).
            found = _zero_cost_match(mesh, strategy_schema, info, out_meta)
            if found is not None and not _keeps_placements(found, strategy_schema):
                found = None
        else:
            found = _dijkstra_expand_single_dim_strategy_to_mesh(mesh, strategy_schema, info, out_meta)
            if found is None:
                found = _zero_cost_match(mesh, strategy_schema, info, out_meta)
            if found is None:
                found = _slice_match(mesh, strategy_schema, info, out_meta)
        if found is not None:
            return found
        expand = _expand_single_dim_strategy_to_mesh(mesh, strategy_schema, info, out_meta)
        return expand(strategy_schema.op, strategy_schema.args_meta, strategy_schema.kwargs_meta)

    strategy.single_dim_info = info  # marks the rule as PyTorch's single-dim one, searched here (zerocost.py)
    return strategy


def _searchable(op) -> bool:
    # Foreach and fused-optimizer ops take tensor lists; PyTorch expands those per element itself.
    return not op.name().startswith(("aten::_foreach_", "aten::_amp_foreach_", "aten::_fused_"))


def install_fast_search() -> None:
    """Route every single-dim-strategy op through the cheap search (idempotent)."""
    prop = _propagator()
    if PATCHES.owners(_OWNER):
        return
    for op, info in list(prop.op_single_dim_strategy_funcs.items()):
        if not _searchable(op):
            continue
        # Some ops (mm, bmm, addmm) also carry an older op-strategy function that the single-dim
        # one shadows; undo puts it back. The op's cache schema info stays registered under the
        # single-dim table, where DTensor's dispatcher looks for it when the strategy table has none.
        PATCHES.set_item(_OWNER, prop.op_strategy_funcs, op, _searched(info), f"DTensor strategy {op}")
        PATCHES.delete_item(_OWNER, prop.op_single_dim_strategy_funcs, op, f"DTensor single-dim strategy {op}")


def uninstall_fast_search() -> None:
    """Give PyTorch back its own exhaustive expansion."""
    PATCHES.undo(_OWNER)


