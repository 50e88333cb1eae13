"""Sharding rules that keep ``InterleavedShard`` tensors local where a model splits its sections.

DTensor's own rules treat an interleaved (``_StridedShard``) dim like any sharded dim in ``split``
and ``cat``: they gather it first. But splitting a tensor laid out as ``InterleavedShard(d, k)``
into its ``k`` equal sections along ``d`` needs no communication: every rank holds its slice of
every section, in section order, so the local ``split`` yields each section as a ``Shard(d)``. The
reverse — ``cat`` of ``k`` equally sized ``Shard(d)`` tensors along ``d`` (the backward of that
split, or a model fusing q|k|v itself) — is an ``InterleavedShard(d, k)``.

Slices of an interleaved dim at its section boundaries (``aten.slice`` with step 1: basic indexing
``x[..., a:b]``, ``narrow``) are the same: HF's Phi-3 takes q, k and v from its fused projection's
output with ``qkv[..., :pos]``, ``qkv[..., pos:pos + kv]``, ``qkv[..., pos + kv:]``. A slice of
``j`` whole sections of an ``InterleavedShard(d, k)`` tensor is this rank's slice of each of them,
contiguous on the local shard: ``Shard(d)`` for one section, ``InterleavedShard(d, j)`` for several
(``_local_slice``). Its backward, ``slice_backward`` of a gradient sharded along the sliced dim, puts
this rank's piece into its slice of each section of zeros: ``InterleavedShard(d, k)`` of the whole
dim, with no communication (``_local_slice_backward``; a section is the gradient's length over its
own interleave). DTensor runs both ops on the local tensors with the schema's arguments: the bounds
are made local by size adjusters, as split's sizes are. Other slices of a sharded dim gather it, as
DTensor's rule does.

The ``cat`` rule also skips 1-D empty inputs, as ``torch.cat`` does (an empty KV cache meets the
keys: HF models' default ``use_cache=True``).

Matmuls (``mm``, ``bmm``, ``_grouped_mm``: HF's experts kernels) with an interleaved operand run on
the local shards too: a column-split weight gives interleaved output columns, a split contraction a
Partial sum (``_local_matmul``); PyTorch's rules would gather the weight on every call.

The rules are added in front of PyTorch's strategy functions for ``split`` / ``split_with_sizes``,
``slice`` / ``slice_backward``, ``cat`` and the matmuls through the propagator's own strategy table (``install()``, never at
import); every other case goes to PyTorch's function unchanged. (``chunk`` reaches DTensor as
``split``.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from vescale._torch import (
    DTensorSpec, OpSchema, OpSpec, OpStrategy, TupleStrategy, compute_local_shape_and_global_offset,
    compute_local_stride, _is_shard_like, PATCHES,
)

from ...placement import InterleavedShard, interleave_of, is_interleaved
from ..metas import local_shape
from vescale.memo import Memo

__all__ = ["install_interleaved_rules", "uninstall_interleaved_rules", "SIZE_DEPENDENT_OPS", "grouped_mm_layout_key",
           "local_bounds", "slice_sections", "slice_backward_layout"]

aten = torch.ops.aten
_SPLIT_OPS = (aten.split.Tensor, aten.split_with_sizes.default)
_CAT_OPS = (aten.cat.default,)
_SLICE_OPS = (aten.slice.Tensor,)
_SLICE_BACKWARD_OPS = (aten.slice_backward.default,)
_MATMUL_OPS = (aten.mm.default, aten.bmm.default, aten._grouped_mm.default)
# Ops whose decision, where an operand is interleaved, depends on exact sizes, which a shape-free
# cache key leaves out (PyTorch's cat rule compares them). A cat of equal Shard pieces into an
# interleaved result reads only whether the pieces' shapes are equal, and a split of an interleaved
# tensor only its split dim's length: cache.py keeps those in their keys. _grouped_mm's 16-byte row
# rule is in its key too: grouped_mm_layout_key.
SIZE_DEPENDENT_OPS = frozenset(_CAT_OPS)
_OWNER = "dispatch.fast.interleaved"


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


def _slice_args(args: tuple) -> tuple:
    """``slice.Tensor``'s (dim, start, end, step) with its defaults."""
    rest = list(args[1:5])
    rest += [0, None, None, 1][len(rest):]
    return tuple(rest)


def slice_sections(spec: DTensorSpec, dim: int, start: int | None, end: int | None, step: int) -> tuple | None:
    """``(mesh dim, first section, section count)`` where ``slice(dim, start, end, step)`` of a tensor
    laid out as ``spec`` takes whole sections of its one ``InterleavedShard`` of ``dim``, but not all
    of them; else None."""
    if step != 1 or not all(type(v) is int for v in (dim, start) if v is not None) or (end is not None and type(end) is not int):
        return None
    dim = _normalize(dim, len(spec.shape))
    m = _only_sharding_of(spec.placements, dim)
    if m is None or not is_interleaved(spec.placements[m]):
        return None
    length, k = spec.shape[dim], interleave_of(spec.placements[m])
    start = 0 if start is None else (start + length if start < 0 else start)
    end = length if end is None else (end + length if end < 0 else end)
    start, end = min(max(start, 0), length), min(max(end, 0), length)
    section = length // k
    if length % k or end <= start or start % section or end % section or end - start == length:
        return None
    return m, start // section, (end - start) // section


def _sectioned(p, dim: int, count: int):
    """The placement of ``count`` sections cut from interleaved ``p`` along ``dim``."""
    return Shard(dim) if count == 1 else InterleavedShard(dim, count)


def local_bounds(spec: DTensorSpec, mesh_dim: int, dim: int, first: int, count: int, section: int) -> tuple:
    """This rank's (start, end) along ``dim`` of sections ``[first, first + count)`` of length
    ``section`` on a tensor interleaved along ``dim`` over ``mesh_dim``: each section is cut as a
    ``Shard`` over that mesh dim (``_StridedShard``'s layout), the rank's pieces laid end to end."""
    piece, _ = Shard(dim).local_shard_size_and_offset(section, spec.mesh.size(mesh_dim), spec.mesh.get_coordinate()[mesh_dim])
    return first * piece, (first + count) * piece


def _sliced_sections(spec: DTensorSpec, schema: OpSchema) -> tuple | None:
    """``(mesh dim, first section, section count, dim)`` of a slice call that takes whole sections
    of ``spec``'s ``InterleavedShard`` dim, else None."""
    dim, start, end, step = _slice_args(schema.args_schema)
    found = slice_sections(spec, dim, start, end, step)
    return None if found is None else (*found, _normalize(dim, len(spec.shape)))


def _local_slice(schema: OpSchema) -> OpStrategy | None:
    """``slice`` of whole sections of an ``InterleavedShard`` dim (see the module doc)."""
    strategy = schema.args_schema[0]
    if not isinstance(strategy, OpStrategy) or len(strategy.strategies) != 1:
        return None
    spec = strategy.strategies[0].output_spec
    found = _sliced_sections(spec, schema)
    if found is None:
        return None
    m, _, count, dim = found
    out = tuple(_sectioned(p, dim, count) if i == m else p for i, p in enumerate(spec.placements))
    return OpStrategy([OpSpec(output_specs=DTensorSpec(spec.mesh, out), input_specs=(spec,), redistribute_cost=[[0.0]])])


def _local_slice_args(specs: list[DTensorSpec], schema: OpSchema) -> OpSchema:
    """The slice's bounds made local where the chosen strategy keeps the interleaved input."""
    spec = specs[0]
    found = _sliced_sections(spec, schema)
    if found is None:
        return schema
    m, first, count, dim = found
    section = spec.shape[dim] // interleave_of(spec.placements[m])
    start, end = local_bounds(spec, m, dim, first, count, section)
    args = (schema.args_schema[0], dim, start, end, 1)
    return OpSchema(schema.op, args, schema.kwargs_schema, schema_info=schema.schema_info)


def _backward_sections(spec: DTensorSpec, dim, start, step, length=None) -> tuple | None:
    """For ``slice_backward(grad, input_sizes, dim, start, end, step)`` with the gradient laid out as
    ``spec``: ``(mesh dim, first section, section count, section length)`` where the gradient is
    sharded along ``dim`` on one mesh dim (its sections: one for ``Shard``, its interleave for
    ``InterleavedShard``) and the slice starts at a section boundary; where the input's ``length``
    along ``dim`` is given, also that the slice sits on whole sections of it and is not all of it. A
    start counted from the end (autograd passes the forward's bounds as written: ``x[..., -8:]``)
    gives a negative first section, counted from the end too, where no length is given."""
    if step != 1 or type(dim) is not int or type(start) is not int:
        return None
    dim = _normalize(dim, len(spec.shape))
    m = _only_sharding_of(spec.placements, dim)
    if m is None:
        return None
    p = spec.placements[m]
    count = interleave_of(p) if is_interleaved(p) else 1
    grad_length = spec.shape[dim]
    if grad_length % count or grad_length == 0:
        return None
    section = grad_length // count
    if length is not None:
        if type(length) is not int:
            return None
        start = start + length if start < 0 else start
        if start < 0 or length % section or start + grad_length > length or grad_length == length:
            return None
    if start % section:
        return None
    return m, start // section, count, section


def slice_backward_layout(spec: DTensorSpec, input_sizes: Sequence[int], dim: int, start: int, step: int) -> tuple | None:
    """``(first section, section count, sections in the dim)`` where ``_local_slice_backward`` keeps
    the gradient laid out as ``spec`` sharded (what its decision reads of the sizes), else None."""
    if type(dim) is not int or not -len(input_sizes) <= dim < len(input_sizes):
        return None
    found = _backward_sections(spec, dim, start, step, input_sizes[dim])
    return None if found is None else (found[1], found[2], input_sizes[dim] // found[3])


def _local_slice_backward(schema: OpSchema) -> OpStrategy | None:
    """``slice_backward`` of a gradient sharded along the sliced dim into whole sections (module doc)."""
    strategy = schema.args_schema[0]
    if not isinstance(strategy, OpStrategy) or len(strategy.strategies) != 1:
        return None
    spec = strategy.strategies[0].output_spec
    input_sizes, dim, start, _, step = schema.args_schema[1:6]
    if type(dim) is not int or not -len(input_sizes) <= dim < len(input_sizes):
        return None
    length = input_sizes[dim]
    found = _backward_sections(spec, dim, start, step, length)
    if found is None:
        return None
    m, section = found[0], found[3]
    dim = _normalize(dim, len(spec.shape))
    out = tuple(InterleavedShard(dim, length // section) if i == m else p for i, p in enumerate(spec.placements))
    return OpStrategy([OpSpec(output_specs=DTensorSpec(spec.mesh, out), input_specs=(spec,), redistribute_cost=[[0.0]])])


def _local_slice_backward_args(specs: list[DTensorSpec], schema: OpSchema) -> OpSchema:
    """The bounds made local where the chosen strategy keeps the gradient sharded along the sliced
    dim (PyTorch's rule never does). ``input_sizes`` are local here already (DTensor rewrites them
    first: ``op_to_shape_and_stride_idx``), so a first section counted from the end is counted from
    the local end."""
    spec = specs[0]
    grad, input_sizes, dim, start, _, step = schema.args_schema[:6]
    found = _backward_sections(spec, dim, start, step)
    if found is None:
        return schema
    m, first, count, section = found
    dim = _normalize(dim, len(spec.shape))
    start, end = local_bounds(spec, m, dim, first, count, section)
    if first < 0:
        start, end = start + input_sizes[dim], end + input_sizes[dim]
    return OpSchema(schema.op, (grad, input_sizes, dim, start, end, 1), schema.kwargs_schema, schema_info=schema.schema_info)


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


def _like(p, dim: int):
    """A placement of the same kind as the shard ``p`` on tensor dim ``dim``."""
    return InterleavedShard(dim, interleave_of(p)) if is_interleaved(p) else Shard(dim)


def _same_split(p, q) -> bool:
    return (is_interleaved(p) and is_interleaved(q) and interleave_of(p) == interleave_of(q)) or (
        type(p) is Shard and type(q) is Shard
    )


def _aligned_rows(spec: DTensorSpec) -> bool:
    """Whether the local shard keeps ``_grouped_mm``'s rule that an operand's row stride is a multiple
    of 16 bytes. Only a split of one of the last two dims changes the local strides (a transposed
    operand has its row stride there too), so its local size must be a multiple of 16 bytes."""
    ndim = len(spec.shape)
    for m, p in enumerate(spec.placements):
        if _is_shard_like(p) and p.dim % ndim >= ndim - 2:
            local = spec.shape[p.dim] // spec.mesh.size(m)
            if spec.tensor_meta is None or local * spec.tensor_meta.dtype.itemsize % 16:
                return False
    return True


def _kernel_strides(spec: DTensorSpec) -> bool:
    """Whether the local shard at the spec's placements passes ``_grouped_mm``'s stride rule (the
    meta kernel's ``check_valid_strides``, which PyTorch's strategy filter applies to every
    candidate's local metadata): the last two dims row- or column-major, the leading stride a
    multiple of 16 bytes."""
    meta = spec.tensor_meta
    shape = local_shape(meta.shape, spec.mesh, spec.placements)  # arithmetic where it knows the placements
    if shape is None:
        shape, _ = compute_local_shape_and_global_offset(meta.shape, spec.mesh, spec.placements, skip_offset=True)
    stride = compute_local_stride(meta.stride, shape)
    end, align = len(shape) - 1, 16 // meta.dtype.itemsize
    if stride[end - 1] == 1 and stride[end] >= max(1, shape[end - 1]):
        return stride[end] % align == 0
    if stride[end] == 1 and stride[end - 1] >= max(1, shape[end]):
        return stride[end - 1] % align == 0
    return False


def grouped_mm_layout_key(schema: OpSchema) -> tuple:
    """What ``_grouped_mm``'s decision reads of the operands' sizes beyond a shape-free cache key:
    per operand, whether its local shard as it is placed keeps the kernel's stride rule, as
    PyTorch's filter tests it and as ``_aligned_rows`` does for the interleaved rule above. A
    decision that moves no input is the one strategy that matches the inputs as they are (the
    per-mesh-dim strategies of both rules have distinct input placements, and PyTorch prefers a
    strategy that moves nothing), which these bits keep valid or not: with them in the key such a
    decision holds at every size."""
    return tuple(_layout_bits(s) for s in schema.args_schema[:2])


# (sizes, strides, ids of dtype, mesh and placements) -> (mesh, placements, _layout_bits): weights
# repeat at every length. Ids, not the objects: hashing a mesh or placements runs Python per call;
# the entry keeps both objects alive, so their ids stay theirs (dtypes are singletons).
_LAYOUT_BITS = Memo("interleaved layout bits", 4096)


def _layout_bits(spec: DTensorSpec) -> tuple:
    meta, mesh, placements = spec.tensor_meta, spec.mesh, spec.placements
    memo = (meta.shape, meta.stride, id(meta.dtype), id(mesh), id(placements))
    found = _LAYOUT_BITS.get(memo)
    if found is None or found[0] is not mesh or found[1] is not placements:
        found = _LAYOUT_BITS.put(memo, (mesh, placements, (_kernel_strides(spec), _aligned_rows(spec))))
    return found[2]


def _local_matmul(schema: OpSchema) -> OpStrategy | None:
    """``mm`` / ``bmm`` / ``_grouped_mm`` with an ``InterleavedShard`` operand, computed on the local
    shards as they are: the sections of a column-split weight (HF's fused gate|up experts) give
    output columns in the same interleaved layout, a row-split contraction gives a Partial sum, a
    row-split left operand gives output rows laid out alike. DTensor's own rules do not know
    ``_StridedShard`` and gather the weight on every call. Other layouts: PyTorch's rule."""
    a, b = schema.args_schema[:2]
    offs = schema.args_schema[2] if len(schema.args_schema) > 2 else None
    if not all(isinstance(x, OpStrategy) and len(x.strategies) == 1 for x in (a, b)):
        return None
    sa, sb = a.strategies[0].output_spec, b.strategies[0].output_spec
    if not any(is_interleaved(p) for p in (*sa.placements, *sb.placements)):
        return None
    inputs = [sa, sb]
    if isinstance(offs, OpStrategy):
        so = offs.strategies[0].output_spec
        if not all(p.is_replicate() for p in so.placements):
            return None
        inputs.append(so)
    na, nb = len(sa.shape), len(sb.shape)
    grouped = schema.op is aten._grouped_mm.default
    if (na, nb) not in ((2, 2), (3, 3), (2, 3)) or (not grouped and na != nb):
        return None
    if grouped and not all(_aligned_rows(spec) for spec in (sa, sb)):
        return None  # the kernel needs 16-byte row strides; the local shard would not have them
    nout = {(2, 2): 3, (2, 3): 2}.get((na, nb), na) if grouped else na  # (2, 3): one row per token
    rows_ok = not (grouped and (na, nb) == (2, 3))  # offs groups a's rows there
    contraction_ok = not (grouped and (na, nb) == (2, 2))  # ... and the contraction here
    out, want_a, want_b = [], list(sa.placements), list(sb.placements)
    for m, (pa, pb) in enumerate(zip(sa.placements, sb.placements)):
        if pa.is_replicate() and pb.is_replicate():
            out.append(Replicate())
        elif pa.is_replicate() and _is_shard_like(pb) and pb.dim == nb - 1:
            out.append(_like(pb, nout - 1))
        elif pb.is_replicate() and _is_shard_like(pa) and pa.dim == na - 2 and rows_ok:
            out.append(_like(pa, nout - 2))
        elif _is_shard_like(pa) and _is_shard_like(pb) and pa.dim == na - 1 and pb.dim == nb - 2 and _same_split(pa, pb) and contraction_ok:
            out.append(Partial())
        elif pa.is_replicate() and _is_shard_like(pb) and pb.dim == nb - 2 and contraction_ok:
            want_a[m] = _like(pb, na - 1)  # a replicated operand is sliced locally to match
            out.append(Partial())
        elif pb.is_replicate() and _is_shard_like(pa) and pa.dim == na - 1 and contraction_ok:
            want_b[m] = _like(pa, nb - 2)
            out.append(Partial())
        else:
            return None
    moved = [DTensorSpec(sa.mesh, tuple(want_a), tensor_meta=sa.tensor_meta), DTensorSpec(sb.mesh, tuple(want_b), tensor_meta=sb.tensor_meta)]
    costs = [[0.0 if want.placements == have.placements else 1.0] for want, have in zip(moved, (sa, sb))]
    spec = OpSpec(
        output_specs=DTensorSpec(sa.mesh, tuple(out)),
        input_specs=tuple(moved + inputs[2:]),
        redistribute_cost=costs + [[0.0]] * (len(inputs) - 2),
    )
    return OpStrategy([spec])


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
    def strategy(schema: OpSchema) -> OpStrategy | TupleStrategy:
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
    if PATCHES.owners(_OWNER):
        return
    # DTensor runs these ops on local tensors: their size and bound arguments must be local
    for ops, adjuster in ((_SPLIT_OPS, _local_split_args), (_SLICE_OPS, _local_slice_args),
                          (_SLICE_BACKWARD_OPS, _local_slice_backward_args)):
        for op in ops:
            if op not in prop.op_to_scalar_shape_adjuster:
                PATCHES.set_item(_OWNER, prop.op_to_scalar_shape_adjuster, op, adjuster, f"DTensor shape adjuster {op}")
    for ops, rule in ((_SPLIT_OPS, _local_split), (_CAT_OPS, _local_cat), (_MATMUL_OPS, _local_matmul),
                      (_SLICE_OPS, _local_slice), (_SLICE_BACKWARD_OPS, _local_slice_backward)):
        for op in ops:
            if op in table:
                PATCHES.set_item(_OWNER, table, op, _with_rule(rule, table[op]), f"DTensor strategy {op}")


def uninstall_interleaved_rules() -> None:
    PATCHES.undo(_OWNER)


