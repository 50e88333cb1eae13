"""Sharding rules that keep ``InterleavedShard`` tensors local where a model splits its sections.

DTensor's own rules treat an interleaved (``_StridedShard``) dim like any sharded dim in ``split``
and ``cat``: they gather it first. But splitting a tensor laid out as ``InterleavedShard(d, k)``
into its ``k`` equal sections along ``d`` needs no communication: every rank holds its slice of
every section, in section order, so the local ``split`` yields each section as a ``Shard(d)``. The
reverse — ``cat`` of ``k`` equally sized ``Shard(d)`` tensors along ``d`` (the backward of that
split, or a model fusing q|k|v itself) — is an ``InterleavedShard(d, k)``.

The ``cat`` rule also skips 1-D empty inputs, as ``torch.cat`` does (an empty KV cache meets the
keys: HF models' default ``use_cache=True``).

Both rules are added in front of PyTorch's strategy functions for ``split`` / ``split_with_sizes``
and ``cat`` through the propagator's own strategy table (``install()``, never at import); every
other case goes to PyTorch's function unchanged. (``chunk`` reaches DTensor as ``split``.)
"""

from __future__ import annotations

import threading

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.distributed.tensor.placement_types import _is_shard_like

from ..placement import InterleavedShard, interleave_of, is_interleaved

__all__ = ["install_interleaved_rules", "uninstall_interleaved_rules"]

aten = torch.ops.aten
_SPLIT_OPS = (aten.split.Tensor, aten.split_with_sizes.default)
_CAT_OPS = (aten.cat.default,)
_LOCK = threading.Lock()
_SAVED: dict = {}  # op -> PyTorch's strategy function, while installed


def _normalize(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _only_sharding_of(placements, dim: int) -> int | None:
    """The one mesh dim that shards tensor dim ``dim``, or None (none, or several)."""
    found = [m for m, p in enumerate(placements) if _is_shard_like(p) and p.dim == dim]
    return found[0] if len(found) == 1 else None


def _split_sizes(schema: OpSchema, length: int) -> list[int]:
    size = schema.args_schema[1]
    if isinstance(size, int):
        return [size] * (length // size) + ([length % size] if length % size else [])
    return list(size)


def _local_split(schema: OpSchema) -> OpStrategy | None:
    """``split`` of an ``InterleavedShard(d, k)`` tensor into its ``k`` sections along ``d``."""
    strategy = schema.args_schema[0]
    if not isinstance(strategy, OpStrategy) or len(strategy.strategies) != 1:
        return None
    spec = strategy.strategies[0].output_spec
    dim = _normalize(schema.args_schema[2] if len(schema.args_schema) > 2 else 0, len(spec.shape))
    m = _only_sharding_of(spec.placements, dim)
    if m is None or not is_interleaved(spec.placements[m]):
        return None
    k, length = interleave_of(spec.placements[m]), spec.shape[dim]
    sizes = _split_sizes(schema, length)
    if len(sizes) != k or len(set(sizes)) != 1:
        return None  # not the sections: PyTorch's rule (gather first) is the right one
    out = tuple(Shard(dim) if i == m else p for i, p in enumerate(spec.placements))
    outputs = tuple(DTensorSpec(spec.mesh, out) for _ in sizes)
    return OpStrategy([OpSpec(output_specs=outputs, input_specs=(spec,), redistribute_cost=[[0.0]])])


def _local_split_args(specs: list[DTensorSpec], schema: OpSchema) -> OpSchema:
    """The split's size argument in local sizes, where the chosen strategy splits the sections on
    the local shard (DTensor runs the op on local tensors with the schema's arguments)."""
    (spec,) = specs[:1]
    local = _local_split(OpSchema(schema.op, (OpStrategy([OpSpec(spec)]), *schema.args_schema[1:]), {}))
    if local is None:
        return schema
    dim = _normalize(schema.args_schema[2] if len(schema.args_schema) > 2 else 0, len(spec.shape))
    m = _only_sharding_of(spec.placements, dim)
    k = interleave_of(spec.placements[m])
    section, _ = Shard(dim).local_shard_size_and_offset(spec.shape[dim] // k, spec.mesh.size(m), spec.mesh.get_coordinate()[m])
    size = section if isinstance(schema.args_schema[1], int) else [section] * k
    args = (schema.args_schema[0], size, *schema.args_schema[2:])
    return OpSchema(schema.op, args, schema.kwargs_schema, schema_info=schema.schema_info)


def _local_cat(schema: OpSchema) -> OpStrategy | None:
    """``cat`` of ``k`` equal ``Shard(d)`` tensors (same placements) along ``d``."""
    items = schema.args_schema[0]
    if not isinstance(items, TupleStrategy) or len(items.children) < 2:
        return None
    if not all(isinstance(c, OpStrategy) and len(c.strategies) == 1 for c in items.children):
        return None
    specs = [c.strategies[0].output_spec for c in items.children]
    first = specs[0]
    dim = _normalize(schema.args_schema[1] if len(schema.args_schema) > 1 else 0, len(first.shape))
    if any(s.placements != first.placements or tuple(s.shape) != tuple(first.shape) for s in specs):
        return None
    m = _only_sharding_of(first.placements, dim)
    if m is None or type(first.placements[m]) is not Shard:
        return None
    k = len(specs)
    out = tuple(InterleavedShard(dim, k) if i == m else p for i, p in enumerate(first.placements))
    return OpStrategy(
        [OpSpec(output_specs=DTensorSpec(first.mesh, out), input_specs=tuple(specs), redistribute_cost=[[0.0]] * k)]
    )


def _legacy_empty(strategy) -> bool:
    return isinstance(strategy, OpStrategy) and tuple(strategy.strategies[0].output_spec.shape) == (0,)


def _cat_with_legacy_empty(schema: OpSchema, original) -> OpStrategy | None:
    """``cat`` skips 1-D empty tensors of any placement (PyTorch's legacy rule; an empty KV cache
    is one: ``torch.cat([cache, keys], dim=-2)``). DTensor's rule would redistribute the empty
    tensor to the others' sharding on a dim it does not have; decide without it instead, and
    leave it as it is."""
    items = schema.args_schema[0]
    if not isinstance(items, TupleStrategy):
        return None
    empty = [i for i, c in enumerate(items.children) if _legacy_empty(c)]
    if not empty or len(empty) == len(items.children):
        return None
    rest = TupleStrategy([c for i, c in enumerate(items.children) if i not in empty])
    sub = OpSchema(schema.op, (rest, *schema.args_schema[1:]), schema.kwargs_schema, schema_info=schema.schema_info)
    found = _local_cat(sub) or original(sub)
    strategies = []
    for spec in found.strategies:
        inputs, costs = list(spec.input_specs), list(spec.redistribute_cost)
        for i in empty:
            inputs.insert(i, items.children[i].strategies[0].output_spec)
            costs.insert(i, [0.0] * len(items.children[i].strategies))
        strategies.append(OpSpec(output_specs=spec.output_specs, input_specs=tuple(inputs), redistribute_cost=costs))
    return OpStrategy(strategies)


def _with_rule(rule, original):
    def strategy(schema: OpSchema):
        found = rule(schema)
        if found is None and rule is _local_cat:
            found = _cat_with_legacy_empty(schema, original)
        return found if found is not None else original(schema)

    strategy.__wrapped__ = original
    return strategy


def install_interleaved_rules() -> None:
    """Put the rules in front of PyTorch's split / cat strategies (idempotent)."""
    prop = DTensor._op_dispatcher.sharding_propagator
    table = prop.op_strategy_funcs
    with _LOCK:
        for op in _SPLIT_OPS:  # DTensor runs split on local tensors: its size argument must be local
            prop.op_to_scalar_shape_adjuster.setdefault(op, _local_split_args)
        for ops, rule in ((_SPLIT_OPS, _local_split), (_CAT_OPS, _local_cat)):
            for op in ops:
                if op not in _SAVED and op in table:
                    _SAVED[op] = table[op]
                    table[op] = _with_rule(rule, table[op])


def uninstall_interleaved_rules() -> None:
    prop = DTensor._op_dispatcher.sharding_propagator
    table = prop.op_strategy_funcs
    with _LOCK:
        for op in _SPLIT_OPS:
            if prop.op_to_scalar_shape_adjuster.get(op) is _local_split_args:
                del prop.op_to_scalar_shape_adjuster[op]
        for op, original in _SAVED.items():
            table[op] = original
        _SAVED.clear()
