"""Cost-searched decisions that move only replicated inputs: the same at every size.

Where the inputs as they are match none of an op's strategies, PyTorch prices candidates by their
redistribution cost and takes the cheapest. Moving a Replicate placement (to a Shard, a Partial or
a masked Partial) costs exactly 0 at any size: ``redistribute_cost`` short-cuts a replicated
source, and the per-step ``_compute_placement_transition_cost`` prices Replicate -> Shard and
Replicate -> Partial at 0.0; every other change on a mesh dim costs at least the 6.6 us base
latency. So when PyTorch's answer moves only Replicate placements, it is a zero-cost strategy, and
which zero-cost strategy wins does not depend on sizes either:

* the full expansion (``_select_min_cost_strategy``) takes the first zero-cost strategy in its
  list's order (a strategy that moves nothing would be preferred, but then the decision moves
  nothing);
* the priority-queue search (``search.py``, PyTorch's ``_dijkstra_expand_single_dim_strategy_to_mesh``)
  pops every zero-cost state, in the order of their pushes, before any state that costs more,
  so it returns the first matching zero-cost state of a sequence fixed by placements alone.

Both hold while the candidate list is a function of what the shape-free key keeps. That is checked
rule by rule (``_size_free_rule``): PyTorch's single-dim rules of elementwise ops (ranks and size-1
broadcast dims, which the key keeps), of ``mm`` and ``bmm`` (their einsum equation), of ``index_put``
(index structure, ranks) and of ``embedding``
(ranks, and the weight's shape, which its masked Partial carries: ``embedding_key`` puts it in the
key), and ``scatter`` (its shardable axes are those where the operands' sizes agree: ``scatter_axes``
puts them in the key). A reused masked Partial shares its mask buffer between calls, as PyTorch's
own sharding cache does at a repeated shape. The one size test left is shardability: a candidate that shards a dim needs at least as many
rows as shards there. ``room`` says, per dim, which of the mesh's possible shard counts fit; an
entry is reused only at the ``room`` it was learned at (``SameRoom``), so every candidate passes or
fails that test as it did.

``cache.py`` learns such a decision as it learns one-strategy moves: verified once against
PyTorch's full answer, then replayed with new metadata at the same ``room``.
"""

from __future__ import annotations

from typing import Any

import torch
from vescale._torch import DTensorSpec, OpSchema, OutputSharding, _tensor_ops, _StridedShard

from ..metas import _is_elementwise, mesh_shape

__all__ = ["free_move", "room", "SameRoom", "scatter_axes", "embedding_key"]

aten = torch.ops.aten


def _single_dim(prop, op) -> bool:
    """Whether the op's rule is PyTorch's single-dim one, searched by ``search.py``; also behind
    ``interleaved.py``'s matmul rule, which answers for ``_StridedShard`` operands only (and a
    free move has none: ``_plain_specs``)."""
    rule = prop.op_strategy_funcs.get(op)
    return getattr(rule, "single_dim_info", None) is not None or getattr(
        getattr(rule, "__wrapped__", None), "single_dim_info", None) is not None


def _scatter_rule(prop, op) -> bool:
    """PyTorch's ``scatter_strategy``, alone or behind ``partial.py``'s Partial strategy."""
    rule = prop.op_strategy_funcs.get(op)
    return rule is _tensor_ops.scatter_strategy or getattr(rule, "__wrapped__", None) is _tensor_ops.scatter_strategy


def _size_free_rule(prop, op_schema: OpSchema) -> bool:
    op = op_schema.op
    if op_schema.is_inplace_op() or op_schema.is_out_variant_op():
        return False  # their result must keep a tensor's placements: another selection
    if op is aten.scatter.src:
        return _scatter_rule(prop, op)
    return (op in _SINGLE_DIM_OPS or _is_elementwise(op)) and _single_dim(prop, op)


# Ops whose PyTorch single-dim rule reads only what the key keeps: index_put (which dims are
# indexed, ranks), embedding (ranks, and the weight's shape for its masked Partial: ``embedding_key``),
# mm and bmm (their einsum equation alone: ``gen_single_dim_einsum_strategies``). A linear's weight
# gradient under DP x TP is such a move: activations (Shard(0), R) times a row-split gradient
# (R, Shard(0)) slice the replicated activations' columns for a Partial sum, at every length.
_SINGLE_DIM_OPS = (aten.index_put.default, aten.embedding.default, aten.mm.default, aten.bmm.default)


def _moves_only_replicate(given: DTensorSpec, wanted: DTensorSpec) -> bool:
    return given.mesh == wanted.mesh and all(
        g == w or g.is_replicate() for g, w in zip(given.placements, wanted.placements))


def _plain_specs(specs) -> bool:
    return all(not isinstance(p, _StridedShard) for s in specs for p in s.placements)


def _thresholds(mesh) -> tuple:
    """The shard counts a dim can get on ``mesh``: the products of its dims' sizes over subsets."""
    shape = mesh_shape(mesh)
    found = _THRESHOLDS.get(shape)
    if found is None:
        counts = {1}
        for n in shape:
            counts |= {c * n for c in counts}
        found = _THRESHOLDS[shape] = tuple(sorted(c for c in counts if c > 1))
    return found


_THRESHOLDS: dict = {}


def room(op_schema: OpSchema) -> tuple | None:
    """Per dim of every tensor argument, how many of the mesh's possible shard counts fit in its
    size: what PyTorch's shardability test (``is_tensor_shardable``: no more shards of a dim than
    its size) can answer for any candidate a rule offers. None where a keyword argument holds a
    tensor (the searches do not price those)."""
    if any(isinstance(v, (DTensorSpec, list, tuple)) for v in op_schema.kwargs_schema.values()):
        return None
    return tuple(tuple(sum(s >= c for c in _thresholds(spec.mesh)) for s in spec.tensor_meta.shape)
                 for spec in op_schema.args_spec)


class SameRoom:
    """A cache entry's guard: the call's ``room`` is the one its decision was learned at."""

    __slots__ = ("room",)

    def __init__(self, op_schema: OpSchema):
        self.room = room(op_schema)

    def __call__(self, op_schema: OpSchema) -> bool:
        return room(op_schema) == self.room


def free_move(prop: Any, op_schema: OpSchema, result: OutputSharding) -> bool:
    """Whether ``result`` is a zero-cost move of a size-free rule (see the module doc): it
    redistributes, every input keeps its placement on each mesh dim or had Replicate there, and no
    ``_StridedShard`` or keyword tensor is involved."""
    schema = result.redistribute_schema
    if not result.needs_redistribute or schema is None or result.use_val_from_redistribute_schema:
        return False
    given, wanted = op_schema.args_spec, schema.args_spec
    if len(given) != len(wanted) or not _plain_specs(given) or not _plain_specs(wanted):
        return False
    return (_size_free_rule(prop, op_schema) and room(op_schema) is not None
            and all(_moves_only_replicate(g, w) for g, w in zip(given, wanted)))


def embedding_key(op_schema: OpSchema) -> tuple:
    """The weight's shape: the vocabulary-parallel rule's ``_MaskPartial`` (on the output and the
    indices' target) carries it to mask the indices each rank does not hold."""
    return tuple(op_schema.args_schema[0].shape)


def scatter_axes(op_schema: OpSchema) -> tuple:
    """``scatter``'s sizes as its rule (``scatter_strategy``) reads them: the axes other than
    ``dim`` on which ``self`` and ``index`` (and a tensor ``src``) agree in size, which it offers
    to shard; () where their ranks differ."""
    x, dim, index, *rest = op_schema.args_schema
    src = rest[0] if rest and isinstance(rest[0], DTensorSpec) else None
    if not isinstance(dim, int) or len(x.shape) != len(index.shape) or not x.shape:
        return ()
    dim %= len(x.shape)
    return tuple(d for d in range(len(x.shape)) if d != dim and x.shape[d] == index.shape[d]
                 and (src is None or src.shape[d] == index.shape[d]))
