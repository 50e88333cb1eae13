"""A sharding cache that a new sequence length still hits: the paper's light-weight sharding cache.

PyTorch keys its sharding-propagation caches on the full input specs, global shapes included, so a
batch with a new sequence length misses on every op and pays the whole miss path again (a
FakeTensor run per op to learn output shapes, ~1-3 ms, then the strategy). For most ops the
placement decision does not depend on sizes at all: if the inputs already sit in one of the op's
sharding rules, the op runs on the local shards as they are, whatever their length.

``ShapeFreeCache`` sits in front of PyTorch's miss path. Its key keeps what can change the decision:
the op, every non-tensor argument (a Python scalar with its type), and per tensor its mesh, placements, dtype, rank, which dims have
size 0 or 1 (broadcasting) and, per sharded dim, whether the mesh divides it and gives every rank a
piece (PyTorch's ``is_tensor_evenly_shardable`` / ``is_tensor_shardable`` tests). Three kinds of
decision are reused:

* "plain": no redistribution and no argument rewriting; any op.
* view-like ops (view, _unsafe_view, reshape, expand): the key holds the decision PyTorch's own view
  rule makes at these sizes (``propagate_shape_and_sharding`` over ``dim_maps``), instead of the
  sizes; ``viewkey.py`` asks that rule once per summary of what it reads of the sizes (how dims
  group, whether sharded sizes divide the mesh), not at every new size. Flattening or splitting a dim whose size
  changed is a hit when the decision is the same; an uneven split or a new ``_StridedShard`` split
  factor is a different decision, so a different key. The local size arguments are re-derived
  (``metas.local_shape``, else PyTorch's ``_adjust_shape_and_stride_args``), inputs moved as the
  decision says.
* ops whose PyTorch rule returns a single strategy derived from placements alone (softmax and its
  backward, nll_loss forward and backward: ``_ONE_STRATEGY_RULES``): their redistributions (gather
  the vocabulary dim, replicate a Partial gradient) are replayed with the new sizes.
* ops whose PyTorch rule reads a size argument only as the key keeps it (``_SIZE_ARG_RULES``:
  ``new_zeros`` & co. follow a sharded input only at its own shape; ``slice_backward`` ignores its
  sizes and bounds): keyed without those sizes, their size arguments made local at every hit.
* squeezes (a view rule over the dims of size 1, which the key's size classes keep): PyTorch's
  rewrite to ``squeeze.dims`` of the globally singleton dims is replayed.
* splits (``_keyed_split``) and the cat of equal ``Shard`` pieces into an interleaved tensor: their
  key holds the split dim's length where the input is interleaved, and whether the cat's pieces
  have equal shapes (what vescale's interleaved rules read of the sizes), not the sequence length.

On a hit the output metadata comes from ``metas.py`` (arithmetic where certain, else the op's meta
kernel), not from a FakeTensor run. Every key is verified once: the first time it is seen, the fast
answer is computed beside PyTorch's full one and the key is served only if the two are equal
(output specs, metadata, redistribution and rewritten arguments). A fourth kind, "free": a cost
search's move of replicated inputs alone, which costs 0 at any size and is chosen among zero-cost
candidates in a size-free order, for rules whose candidates the key determines (``zerocost.py``),
reused where every dim fits the mesh's shard counts as it did. ``_grouped_mm`` keys hold its
16-byte stride rule (``interleaved.grouped_mm_layout_key``), so its decisions that move nothing are
"plain". Other decisions of the cost-based search (``search.py``) that move inputs, a cat of
interleaved inputs and data-dependent ops always go to PyTorch; for such a key the first miss also checks ``metas.py``'s
answer against PyTorch's metadata, and later misses (``_Missed``) run PyTorch's strategy on that
answer instead of a FakeTensor run; on a mesh with size-1 dims (TP-only training's ``(1, N)``) it
also checks whether deciding on the mesh without them gives PyTorch's answer, and later misses are
decided there (``unitdims.py``), through this cache: the sub-mesh schema's own key is a hit.
"""


from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from vescale._torch import (
    DTensorSpec, TensorMeta, OpSchema, OutputSharding, _math_ops, _tensor_ops, _skip_dim,
    replicate_reduction_dims, split_strategy, is_tensor_evenly_shardable, _StridedShard, PATCHES,
)
from torch.distributed.tensor.placement_types import Shard

from ..coverage.errors import is_missing_rule, missing_rule_error
from ..local import remember_decision
from .interleaved import (
    _SPLIT_OPS, SIZE_DEPENDENT_OPS, _local_slice_args, _local_slice_backward_args, _local_split_args, grouped_mm_layout_key,
    slice_backward_layout,
)
from ..metas import fast_outputs, kernel_outputs, local_shape, mesh_shape, meta_outputs, miss_outputs, with_meta
from .unitdims import lift, reduce_schema, reducible_mesh, unit_placements
from .viewkey import decision as view_decision
from .zerocost import SameRoom, embedding_key, free_move, scatter_axes
from vescale.memo import Memo

aten = torch.ops.aten
# View-like ops and the function whose dim-mapping rule PyTorch uses for them.
_VIEW_RULES = {
    aten.view.default: torch.Tensor.view,
    aten._unsafe_view.default: torch.Tensor.view,
    aten.view_copy.default: torch.Tensor.view,
    aten.reshape.default: torch.reshape,
    aten.expand.default: torch.Tensor.expand,
    aten.expand_copy.default: torch.Tensor.expand,
}

__all__ = ["ShapeFreeCache", "install_shape_free_cache", "uninstall_shape_free_cache", "shape_free_cache"]

_NEVER = object()  # a key whose decision must not be reused


class _Missed(tuple):
    """An entry whose decision is PyTorch's every time (searched by cost, ...): ``(dtypes, units)``.
    ``dtypes`` (else None): ``_outputs`` gives the output metadata as PyTorch's FakeTensor run does,
    so its misses run PyTorch's strategy with that metadata instead. ``units`` (else None): the
    placements PyTorch chose on the mesh's size-1 dims, where deciding on the mesh without them and
    putting these back gave PyTorch's answer (``unitdims``), so its misses are decided there."""


_LOCK = threading.Lock()
_INSTALLED: list["ShapeFreeCache"] = []
_SET_ASIDE: list["ShapeFreeCache"] = []  # uninstalled with keep_learned=True, for the next install


# A strict view refuses to split a sharded dim into parts the mesh does not divide; reshape's rule
# gathers that dim first. Autograd's own views hit this (the backward of GQA's repeat_kv reshape
# unflattens a heads-split gradient into (kv_heads, n_rep)), so they are decided as reshape is: the
# op then runs as a local view of the gathered tensor.
_STRICT_VIEWS = (aten.view.default, aten._unsafe_view.default)


def _as_reshape(op_schema: OpSchema) -> OpSchema:
    return OpSchema(aten.reshape.default, op_schema.args_schema, op_schema.kwargs_schema,
                    schema_info=op_schema.schema_info)


def _size_class(n: int) -> int:
    return n if n < 2 else 2  # 0 and 1 change broadcasting and shardability; larger sizes do not


_STRIDED, _SHARD = "strided", "shard"
_SHARD_KINDS: dict = {}  # placement type -> _STRIDED, _SHARD or None


def _shard_kind(cls):
    """What ``isinstance`` says of a placement type, asked once per type: placements' metaclass
    answers ``isinstance`` in Python (~0.5 us a call, several per tensor per key)."""
    try:
        return _SHARD_KINDS[cls]
    except KeyError:
        kind = _STRIDED if issubclass(cls, _StridedShard) else _SHARD if issubclass(cls, Shard) else None
        _SHARD_KINDS[cls] = kind
        return kind


_TOKENS: dict = {}  # (mesh, placements) -> a number standing for them in keys (never reused)
_NEXT_TOKEN = itertools.count()
# (id(mesh), id(placements)) -> (mesh, placements, token, shard counts, strided dims); layouts are few,
# the bound is for programs that make many meshes
_LAYOUTS = Memo("shape-free cache layouts", 8192)


def _layout(spec: DTensorSpec) -> tuple:
    """What a key needs of a spec's mesh and placements, worked out once per pair of objects:
    ``(mesh, placements, token, ((tensor dim, ranks splitting it), ...), strided dims)``. Keys hold
    the token instead of the mesh and placements, whose hashes run Python per placement on every
    lookup; replayed specs share their template's placements tuple, so the same objects come back
    step after step. The entry keeps both objects alive, so their ids stay theirs."""
    mesh, placements = spec.mesh, spec.placements
    found = _LAYOUTS.get((id(mesh), id(placements)))
    if found is not None and found[0] is mesh and found[1] is placements:
        return found
    token = _TOKENS.get((mesh, placements))
    if token is None:
        token = _TOKENS[(mesh, placements)] = next(_NEXT_TOKEN)
    shards: dict = {}
    strided = []
    for mesh_size, p in zip(mesh_shape(mesh), placements):
        kind = _shard_kind(type(p))
        if kind is _STRIDED:
            strided.append(p.dim)
        elif kind is _SHARD:
            shards[p.dim] = shards.get(p.dim, 1) * mesh_size
    found = _LAYOUTS.put((id(mesh), id(placements)), (mesh, placements, token, tuple(sorted(shards.items())), tuple(strided)))
    return found


def _shard_fit(shape, layout: tuple) -> tuple:
    """Per sharded tensor dim: whether the mesh divides it and whether every rank gets a piece.
    PyTorch's rules test exactly these (``is_tensor_evenly_shardable``, ``is_tensor_shardable``);
    e.g. nll_loss's mean refuses an uneven split, and strategies that would leave a rank empty are
    dropped. A ``_StridedShard`` dim keeps its exact size (its tests involve the split factor)."""
    fit = tuple((d, shape[d]) for d in layout[4])
    shards = layout[3]
    if shards:
        fit += tuple((d, shape[d] % n == 0, shape[d] >= n) for d, n in shards if d < len(shape))
    return fit


_SHAPE_PARTS = Memo("shape-free cache shape parts", 8192)  # (shape, layout token) -> (size classes, shard fit)


def _shape_part(shape, layout: tuple) -> tuple:
    """What a key keeps of a shape: per dim 0, 1 or "larger", and the shard fit. Many ops of a step
    share a shape and layout, so it is worked out once per pair (a tuple hash, not a loop)."""
    key = (shape, layout[2])
    found = _SHAPE_PARTS.get(key)
    if found is None:
        sizes = tuple([n if n < 2 else 2 for n in shape])  # _size_class per dim, inlined
        found = _SHAPE_PARTS.put(key, (sizes, _shard_fit(shape, layout)))
    return found


def _arg_key(a):
    if type(a) is DTensorSpec or isinstance(a, DTensorSpec):
        meta, layout = a.tensor_meta, _layout(a)
        # id(dtype): dtypes are singletons, and hashing one runs Python (~0.4 us)
        return ("T", layout[2], id(meta.dtype), *_shape_part(meta.shape, layout))
    kind = type(a)
    if kind is int or kind is float or kind is bool:  # the common scalars first (see below)
        return (kind, a)
    if isinstance(a, (list, tuple)):
        return tuple(_arg_key(x) for x in a)
    if isinstance(a, torch.Tensor):  # a plain tensor argument (rare): never shape-free
        raise TypeError
    if isinstance(a, (bool, int, float, complex)):
        # 2 == 2.0 == True as keys, but an int tensor times 2.0 is a float tensor: the type decides
        # the output dtype, which hits take from the learned answer
        return (type(a), a)
    hash(a)  # raises TypeError for unhashable values: such a schema is not cached
    return a


def _view_key(op_schema: OpSchema):
    """A view-like op's key: its input placements and the decision PyTorch's own view rule makes
    for them at these sizes (which input dims stay sharded and where their shards land in the
    output), taken from ``viewkey.decision``: PyTorch's rule asked once per summary of what the
    rule reads of the sizes, not at every new size."""
    spec = op_schema.args_schema[0]
    if not isinstance(spec, DTensorSpec) or op_schema.kwargs_schema:
        raise TypeError
    op, token = op_schema.op, _layout(spec)[2]
    try:
        rank, target, out = view_decision(op_schema, _VIEW_RULES[op], op in _STRICT_VIEWS, mesh_shape(spec.mesh), token)
    except ValueError:  # the rule raises at these sizes: PyTorch's path gives its error (or gathers)
        raise TypeError from None
    return (("T", token, id(spec.tensor_meta.dtype), spec.ndim), rank, target, out)


def _nll_mean_even(op_schema: OpSchema) -> bool | None:
    """nll_loss_forward with mean reduction refuses a target that its input's placements (channel
    dim replicated) would split unevenly; that test must be part of the key."""
    x, target, _, reduction = op_schema.args_schema[:4]
    if reduction != 1 or not isinstance(target, DTensorSpec):
        return None
    channel = 1 if x.ndim >= 2 else 0
    placements = _skip_dim(replicate_reduction_dims(x.placements, [channel]), channel)
    return is_tensor_evenly_shardable(target.shape, DTensorSpec(x.mesh, placements))


def _new_factory_sizes(op_schema: OpSchema) -> dict:
    """new_zeros / new_ones / new_full / new_empty (``new_factory_strategy``): the output follows a
    sharded input (an uninitialised one also a Partial input) only when the requested size equals
    the input's shape, else it is Replicate; the rule reads the size for nothing else."""
    spec, size = op_schema.args_schema[:2]
    return {1: (tuple(_size_class(n) for n in size), tuple(size) == tuple(spec.shape))}


def _slice_backward_sizes(op_schema: OpSchema) -> dict:
    """slice_backward (``slice_backward_rules``): the gradient's placements with the sliced dim
    replicated; input_sizes, start, end and step are not read (the local input_sizes of a sharded
    output are PyTorch's ``_adjust_shape_and_stride_args``' at every hit). The output's sharded dims
    are the gradient's, sizes included, so the gradient's shard fit in the key covers them. vescale's
    rule in front of PyTorch's (``interleaved._local_slice_backward``) keeps a gradient sharded
    along the sliced dim where the slice sits on whole sections: whether it does, and the sections,
    are kept with the dim."""
    grad, sizes, dim = op_schema.args_schema[:3]
    start, _, step = (list(op_schema.args_schema[3:6]) + [None, None, 1])[:3]
    return {1: tuple(_size_class(n) for n in sizes), 2: (dim, slice_backward_layout(grad, sizes, dim, start, step)),
            3: None, 4: None, 5: None}


def _slice_redundant(op_schema: OpSchema) -> bool:
    """``slice`` (``gen_slice_strategy``): a slice of a sharded dim keeps the shards only where it
    is the whole dim, which the sliced dim's length decides (the key keeps the bounds, and exact
    lengths only of interleaved dims, which vescale's rule in front reads:
    ``interleaved._local_slice``)."""
    args = op_schema.args_schema
    spec, (dim, start, end, step) = args[0], (list(args[1:5]) + [0, None, None, 1][len(args) - 1:])[:4]
    length = spec.shape[dim]
    return (start in (None, 0) or start == -length) and (end is None or end >= length) and step == 1


# PyTorch strategies that read a size argument (or a slice's bounds) only through what the function
# beside them keeps: {argument position: its key}; the other arguments are keyed as usual. Such an
# op's decision, size arguments made local included, is then one for every size with that key.
_SIZE_ARG_RULES = {
    _tensor_ops.new_factory_strategy: _new_factory_sizes,
    _tensor_ops.slice_backward_rules: _slice_backward_sizes,
}


def _size_arg_rule(prop, op):
    """The ``_SIZE_ARG_RULES`` entry of the op's strategy function: PyTorch's own, or vescale's
    interleaved rule in front of it (``__wrapped__``; its key function keeps what that rule reads)."""
    rule = prop.op_strategy_funcs.get(op)
    found = _SIZE_ARG_RULES.get(rule)
    if found is None and getattr(rule, "__wrapped__", None) is _tensor_ops.slice_backward_rules:
        found = _SIZE_ARG_RULES[_tensor_ops.slice_backward_rules]
    return found


def _interleaved_split_length(op_schema: OpSchema) -> int | None:
    """A split of a tensor with an interleaved (``_StridedShard``) placement stays local only where
    its pieces are the sections (``interleaved._local_split``), which the split dim's length
    decides: the key keeps that length (the other dims, the sequence among them, stay out)."""
    spec, args = op_schema.args_schema[0], op_schema.args_schema
    if not any(isinstance(p, _StridedShard) for p in spec.placements):
        return None
    return spec.shape[(args[2] if len(args) > 2 else 0) % spec.ndim]


def _equal_cat_shapes(op_schema: OpSchema) -> bool:
    """``cat`` of equally shaped ``Shard(d)`` tensors along ``d`` is an interleaved tensor
    (``interleaved._local_cat``); whether the shapes are equal is all it reads of the sizes."""
    specs = op_schema.args_schema[0]
    return len({tuple(s.shape) for s in specs}) == 1


# Ops whose rules test sizes beyond what ``_arg_key`` keeps: the function gives what they read.
_KEY_EXTRAS = {
    aten.split.Tensor: _interleaved_split_length,
    aten.cat.default: _equal_cat_shapes,
    aten.nll_loss_forward.default: _nll_mean_even,
    aten._grouped_mm.default: grouped_mm_layout_key,
    aten.embedding.default: embedding_key,
    aten.scatter.src: scatter_axes,
    aten.scatter.value: scatter_axes,
    aten.slice.Tensor: _slice_redundant,
}


def _size_arg_keys(prop, op_schema: OpSchema) -> dict:
    sizes = _size_arg_rule(prop, op_schema.op)
    if sizes is None or op_schema.op is aten.new_empty_strided.default:  # its strides: keyed as they are
        return {}
    return sizes(op_schema)


# id(op) -> (op, whether it is view-like, its key extra or None, whether it takes size arguments).
# Keys hold id(op): an OpOverload's hash runs Python (~0.3 us), and ops live as long as the process
# (the entry keeps it alive anyway).
_OP_KINDS: dict = {}


def _op_kind(op, prop) -> tuple:
    found = _OP_KINDS.get(id(op))
    if found is None or found[0] is not op:
        # Only ops with size arguments can have a size-argument rule (``_SIZE_ARG_RULES``); which rule
        # an op has is looked up per call (rules can be installed later), the others skip the lookup.
        sized = op in prop.op_to_shape_and_stride_idx
        found = _OP_KINDS[id(op)] = (op, op in _VIEW_RULES, _KEY_EXTRAS.get(op), sized)
    return found


def _key(op_schema: OpSchema, prop=None):
    """The shape-free key of ``op_schema`` (None: not cached). ``prop``: the sharding propagator
    whose rules decide (DTensor's own by default)."""
    prop = prop or DTensor._op_dispatcher.sharding_propagator
    op = op_schema.op
    _, is_view, extra, has_sizes = _op_kind(op, prop)
    try:
        if is_view:
            return (id(op), _view_key(op_schema))
        sized = _size_arg_keys(prop, op_schema) if has_sizes else None
        if sized:
            args = tuple(sized[i] if i in sized else _arg_key(a) for i, a in enumerate(op_schema.args_schema))
        else:  # most ops: a plain map (this runs for every op at a new length)
            args = tuple(map(_arg_key, op_schema.args_schema))
        kwargs = op_schema.kwargs_schema
        kwargs = tuple(sorted((k, _arg_key(v)) for k, v in kwargs.items())) if kwargs else ()
        if extra is not None:
            args += (extra(op_schema),)
    except Exception:  # unhashable arguments, a rule that does not apply, ...: not cached
        return None
    return (id(op), args, kwargs)


# PyTorch strategies that return exactly one strategy, derived from the input placements alone
# (and the non-tensor arguments and ranks, which keys keep): the softmax dim or the loss's class dim
# is replicated, everything else follows the input. With one strategy no cost is compared, so the
# decision, redistribution included, is the same at every size (nll_loss's mean also refuses an
# uneven target split: ``_nll_mean_even`` puts that test in the key).
_ONE_STRATEGY_RULES = (
    _math_ops.softmax_strategy,
    _math_ops.softmax_backward_strategy,
    _math_ops.nll_loss_forward_strategy,
    _math_ops.nll_loss_backward_strategy,
)


def _decided_by_key(prop, op) -> bool:
    """Whether the key determines a decision that moves inputs or rewrites size arguments: view-like
    ops (their key holds PyTorch's own decision), squeezes (a view rule over the dims of size 1,
    which the key keeps; the rewrite to ``squeeze.dims`` of the globally singleton dims reads those
    alone) and ops still ruled by a one-strategy function above or a size-argument rule
    (``_SIZE_ARG_RULES``)."""
    rule = prop.op_strategy_funcs.get(op)
    return (op in _VIEW_RULES or op in prop.squeeze_op_to_dims_variant or _size_arg_rule(prop, op) is not None
            or any(rule is f for f in _ONE_STRATEGY_RULES))


def _keyed_slice(prop, op_schema: OpSchema) -> bool:
    """A slice or its backward that vescale's interleaved rules decide, in front of PyTorch's
    one-strategy rules, from what the key keeps (``_slice_redundant``, ``_slice_backward_sizes``);
    their bound adjusters make the bounds local at every replay."""
    op, spec = op_schema.op, op_schema.args_schema[0]
    wanted = {aten.slice.Tensor: (_tensor_ops.gen_slice_strategy, _local_slice_args),
              aten.slice_backward.default: (_tensor_ops.slice_backward_rules, _local_slice_backward_args)}.get(op)
    return (wanted is not None and isinstance(spec, DTensorSpec)
            and getattr(prop.op_strategy_funcs.get(op), "__wrapped__", None) is wanted[0]
            and prop.op_to_scalar_shape_adjuster.get(op) is wanted[1])


def _plain_if_unchanged(op_schema: OpSchema, result: OutputSharding) -> OutputSharding:
    """A decision whose "redistribution" moves no input and rewrites no argument (an argument
    adjuster that found nothing to make local: a split or slice of a tensor not interleaved where it
    is cut) is a plain one. PyTorch marks every call of an op with an adjuster so once any input is
    sharded, which sends it down DTensor's Python slow path on every call (2-3x the C++ path's cost
    for a slice on the CPU)."""
    target = result.redistribute_schema
    if not result.needs_redistribute or target is None or target.op is not op_schema.op:
        return result
    if len(target.args_schema) != len(op_schema.args_schema) or target.kwargs_schema != op_schema.kwargs_schema:
        return result
    for a, b in zip(target.args_schema, op_schema.args_schema):
        if isinstance(a, DTensorSpec) or isinstance(b, DTensorSpec):
            if not (isinstance(a, DTensorSpec) and isinstance(b, DTensorSpec) and a.mesh == b.mesh
                    and a.placements == b.placements):
                return result
        elif type(a) is not type(b) or a != b:
            return result
    return OutputSharding(result.output_spec)


def _keyed_split(prop, op_schema: OpSchema) -> bool:
    """A split that vescale's interleaved rule decides from what the key keeps: it passes a tensor
    with no interleaved (``_StridedShard``) placement to PyTorch's ``split_strategy`` (one strategy:
    the split dim unsharded, every piece laid out alike; the number of pieces is checked against
    the metadata on replay), and splits an interleaved one locally where the pieces are its sections
    (the split dim's length is in the key: ``_interleaved_split_length``, or ``split_with_sizes``'
    sizes). The size adjuster (``_local_split_args``) makes the section sizes local at every replay."""
    op, spec = op_schema.op, op_schema.args_schema[0]
    return (op in _SPLIT_OPS and isinstance(spec, DTensorSpec)
            and getattr(prop.op_strategy_funcs.get(op), "__wrapped__", None) is split_strategy
            and prop.op_to_scalar_shape_adjuster.get(op) is _local_split_args)


def _local_size_args(prop, meta: TensorMeta, schema: OpSchema, spec: DTensorSpec) -> OpSchema:
    """PyTorch's ``_adjust_shape_and_stride_args``: the size argument made this rank's shard shape
    of the output, here by arithmetic (``metas.local_shape``) where it covers the placements and the
    op has no stride argument; PyTorch's own function otherwise."""
    index = prop.op_to_shape_and_stride_idx[schema.op]
    local = None if isinstance(index, tuple) else local_shape(meta.shape, spec.mesh, spec.placements)
    if local is None:
        return prop._adjust_shape_and_stride_args(meta, schema, spec)
    args = list(schema.args_schema)
    args[index] = local
    return OpSchema(schema.op, tuple(args), schema.kwargs_schema)


def _output_metas(spec):
    if isinstance(spec, DTensorSpec):
        return spec.tensor_meta
    return tuple(None if s is None else s.tensor_meta for s in spec)  # None marks a masked-off output


def _with_metas(template, metas, mesh, built=False):
    """The template's placements with new metadata, on ``mesh``: the op's own mesh object, never
    the one the template was learned on (``metas.with_meta``). ``built``: the template came out of
    ``DTensorSpec``'s constructor with these placements and flag (``_learn`` stores only such
    templates), so the new spec is a copy of its fields (``with_meta``), several per hit."""

    def one(spec: DTensorSpec | None, meta: TensorMeta | None) -> DTensorSpec | None:
        if spec is None:
            return None
        if built:
            return with_meta(spec, meta, mesh)
        return DTensorSpec(mesh, spec.placements, tensor_meta=meta,
                           use_strided_shard_as_shard_order=spec.use_strided_shard_as_shard_order)

    if isinstance(template, DTensorSpec):
        return one(template, metas)
    return tuple(one(s, m) for s, m in zip(template, metas))


def _same_decision(a: OutputSharding, b: OutputSharding) -> bool:
    return (a.output_spec == b.output_spec and a.redistribute_schema == b.redistribute_schema
            and a.needs_redistribute == b.needs_redistribute
            and a.use_val_from_redistribute_schema == b.use_val_from_redistribute_schema)


def _built_targets(replayed: OutputSharding, op_schema: OpSchema):
    """The input specs a replay built (the redistribution's), or the inputs themselves where it
    built none (a view whose size arguments alone were rewritten): constructor-made either way."""
    if replayed.redistribute_schema is None:
        return op_schema.args_spec
    return replayed.redistribute_schema.args_spec


def _any_interleaved(spec) -> bool:
    """Whether the spec (or any of a tuple of them) has an interleaved (``_StridedShard``) placement."""
    specs = spec if isinstance(spec, tuple) else (spec,)
    return any(isinstance(p, _StridedShard) for s in specs if s is not None for p in s.placements)


def _mesh_of(op_schema: OpSchema):
    first = op_schema.args_schema[0] if op_schema.args_schema else None
    if type(first) is DTensorSpec:  # most ops
        return first.mesh
    for a in (*op_schema.args_schema, *op_schema.kwargs_schema.values()):
        for x in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(x, DTensorSpec):
                return x.mesh
    return None


class ShapeFreeCache:
    """Callable that replaces the propagator's ``propagate_op_sharding_non_cached`` (see module doc)."""

    def __init__(self, propagator):
        self.propagator = propagator
        self.fallback = type(propagator).propagate_op_sharding_non_cached.__get__(propagator)
        self.entries: dict = {}
        self.hits = self.misses = 0
        self._known = threading.local()  # (schema, its output metadata) while its miss is decided
        # While a Static Eager recording watches (``remembering``): the decision given for each schema
        # this step, so that its question "would this op run locally?" (``local.why_rule_not_local``),
        # asked after the op ran, does not propagate the op a second time.

    def _kind(self, op_schema: OpSchema, result: OutputSharding) -> str | None:
        """How a decision can be replayed: "plain" (runs on the local shards as they are), "moved"
        (inputs redistributed to placements the key determines, and/or size arguments rewritten to
        local sizes), "free" (a cost search's zero-cost move of replicated inputs, reused where every
        dim fits the mesh's shard counts as it did: ``zerocost.SameRoom``), or None (never)."""
        prop, op = self.propagator, op_schema.op
        keyed_split = _keyed_split(prop, op_schema) or _keyed_slice(prop, op_schema)
        if op in prop.op_to_scalar_shape_adjuster and not keyed_split:
            return None
        if op in SIZE_DEPENDENT_OPS and _any_interleaved(op_schema.args_spec):
            return None  # a cat of interleaved inputs: PyTorch's rule compares their sizes
        if not result.needs_redistribute:
            return "plain" if result.redistribute_schema is None else None
        if result.redistribute_schema is None:
            return None
        if keyed_split or _decided_by_key(prop, op):
            return "moved"
        return "free" if free_move(prop, op_schema, result) else None

    @staticmethod
    def _outputs(op_schema: OpSchema, dtypes):
        """Output metadata by arithmetic where certain, else the op's meta kernel (None: neither)."""
        metas = fast_outputs(op_schema, dtypes)
        return meta_outputs(op_schema) if metas is None else metas

    def _replay(self, op_schema: OpSchema, template, targets, dtypes, guard=None, built=True) -> OutputSharding | None:
        """The learned decision with this call's metadata; None where ``guard`` (a test the entry's
        reuse depends on: ``zerocost.SameRoom``) fails or the metadata is unknown."""
        if guard is not None and not guard(op_schema):
            return None
        metas = self._outputs(op_schema, dtypes)
        if metas is None:
            return None
        if isinstance(template, tuple) and (not isinstance(metas, (tuple, list)) or len(metas) != len(template)):
            return None
        mesh = _mesh_of(op_schema)
        if mesh is None:
            return None
        spec = _with_metas(template, metas, mesh, built)
        if targets is None:
            return OutputSharding(spec)
        return self._moved(op_schema, spec, metas, targets, mesh, built)

    def _moved(self, op_schema: OpSchema, spec, metas, targets, mesh, built) -> OutputSharding | None:
        """The tail of PyTorch's ``propagate_op_sharding_non_cached`` for a one-strategy decision:
        inputs redistributed to the learned placements, then size arguments made local."""
        args = op_schema.args_spec
        if len(args) != len(targets):
            return None
        needs = any(a.placements != t.placements for a, t in zip(args, targets))

        def expected() -> tuple:  # the inputs' target specs: built only where read (most replays of views and
            # size-argument ops move no input, only their size arguments are made local)
            return tuple(_with_metas(t, a.tensor_meta, mesh, built) for a, t in zip(args, targets))

        suggestion, local_args = None, False
        if needs:
            suggestion = OpSchema(op_schema.op, expected(), {})
            suggestion._inplace_rewrap_schema_suggestion(op_schema)
        prop = self.propagator
        if op_schema.op in prop.op_to_shape_and_stride_idx and any(
            isinstance(p, (Shard, _StridedShard)) for p in spec.placements
        ):
            suggestion = _local_size_args(prop, metas, suggestion or op_schema, spec)
            needs = local_args = True
        adjuster = prop.op_to_scalar_shape_adjuster.get(op_schema.op)  # only a keyed split or slice gets here
        if adjuster is not None and any(isinstance(p, (Shard, _StridedShard)) for t in targets for p in t.placements):
            suggestion = adjuster(list(expected()), suggestion or op_schema)
            needs = local_args = True
        if op_schema.op in prop.squeeze_op_to_dims_variant:
            adjusted = prop._adjust_squeeze_to_global_singletons(suggestion or op_schema)
            if adjusted is not None:
                suggestion, needs, local_args = adjusted, True, True
        return OutputSharding(spec, suggestion, needs_redistribute=needs, use_val_from_redistribute_schema=local_args)

    def __call__(self, op_schema: OpSchema) -> OutputSharding:
        result = self._decide(op_schema)
        remember_decision(op_schema, result)
        return result

    def _decide(self, op_schema: OpSchema) -> OutputSharding:
        key = _key(op_schema, self.propagator)
        entry = self.entries.get(key) if key is not None else None
        if type(entry) is tuple:
            replayed = self._replay(op_schema, *entry)
            if replayed is not None:
                self.hits += 1
                return replayed
        self.misses += 1
        missed = type(entry) is _Missed
        reduced = self._reduced(op_schema) if missed and entry[1] is not None else None
        if reduced is not None:
            # decided on the mesh without its size-1 dims through this cache: that schema's own key,
            # learned at the first miss, is a hit at a new length
            result = lift(self._decide(reduced[0]), *reduced, entry[1])
            if result is not None:
                return result
        known = self._outputs(op_schema, entry[0]) if missed and entry[0] is not None else None
        outer = getattr(self._known, "value", None)  # a miss decided inside another's (decompositions)
        self._known.value = None if known is None else (op_schema, known)
        try:
            return self._miss(op_schema, key, entry)
        finally:
            self._known.value = outer

    @staticmethod
    def _reduced(op_schema: OpSchema):
        """``(schema on the mesh without its size-1 dims, the schema, their indices)`` or None."""
        found = reducible_mesh(op_schema)
        if found is None:
            return None
        _, submesh, dims = found
        return reduce_schema(op_schema, submesh, dims), op_schema, dims

    def known_outputs(self, op_schema: OpSchema) -> TensorMeta | Sequence[Any] | None:
        """The output metadata of the miss being decided, where its key's entry vouches for it
        (``_Missed``); asked by the propagator's tensor-metadata step (``datadep``'s), which
        then runs no FakeTensor."""
        known = getattr(self._known, "value", None)  # unset in a thread that decided no miss yet
        return known[1] if known is not None and known[0] is op_schema else None

    def _miss(self, op_schema: OpSchema, key, entry) -> OutputSharding:
        """PyTorch's miss path (errors made to name the op's module); a first-seen key learned."""
        try:
            result = self.fallback(op_schema)
        except NotImplementedError as e:
            if is_missing_rule(e):  # name the op's module, placements and the plan statement that avoids it
                raise missing_rule_error(op_schema, e) from e
            raise
        except RuntimeError as e:
            if op_schema.op not in _STRICT_VIEWS or "Cannot unflatten unevenly sharded" not in str(e):
                raise
            result = self.fallback(_as_reshape(op_schema))
        result = _plain_if_unchanged(op_schema, result)
        if key is not None and entry is None:
            self.entries[key] = self._learn(op_schema, result)
        return result

    def _learn(self, op_schema: OpSchema, result: OutputSharding):
        """The entry for a first-seen key: replayable only if replaying gives PyTorch's answer."""
        spec = result.output_spec
        if spec is None or (not isinstance(spec, DTensorSpec) and not isinstance(spec, tuple)):
            return _NEVER
        metas = _output_metas(spec)
        if metas is None:
            return _NEVER
        dtypes = metas.dtype if isinstance(metas, TensorMeta) else tuple(m and m.dtype for m in metas)
        kind = self._kind(op_schema, result)
        if kind is None:
            return self._missed(op_schema, result, metas, dtypes)
        targets = None if kind == "plain" else result.redistribute_schema.args_spec
        entry = self._replayable(op_schema, result, targets, dtypes, SameRoom(op_schema) if kind == "free" else None)
        return entry if entry is not None else self._missed(op_schema, result, metas, dtypes)

    def _replayable(self, op_schema: OpSchema, result: OutputSharding, targets, dtypes, guard):
        """The entry that replays ``result`` (inputs moved to ``targets``, if any), or None where
        replaying, once from ``result``'s specs and once from the entry, does not give it back."""
        try:  # built by DTensorSpec's constructor here, so that hits may copy them
            replayed = self._replay(op_schema, result.output_spec, targets, dtypes, built=False)
        except Exception:
            replayed = None
        if replayed is None or not _same_decision(replayed, result):
            return None
        entry = (replayed.output_spec, None if targets is None else _built_targets(replayed, op_schema), dtypes, guard)
        try:
            again = self._replay(op_schema, *entry)
        except Exception:
            again = None
        return entry if again is not None and _same_decision(again, result) else None

    def _missed(self, op_schema: OpSchema, result: OutputSharding, metas, dtypes):
        """The entry of a key whose decision is not replayed as PyTorch gave it: the lift of a
        replayed sub-mesh entry where that is PyTorch's answer (``_lifted_entry``), else ``_Missed``
        where a shortcut for its misses gave PyTorch's answer, else ``_NEVER``."""
        known, units = self._known_metas(op_schema, metas, dtypes), self._unit_dims(op_schema, result)
        lifted = None if units is None else self._lifted_entry(op_schema, result, dtypes)
        if lifted is not None:
            return lifted
        return _NEVER if known is None and units is None else _Missed((known, units))

    def _lifted_entry(self, op_schema: OpSchema, result: OutputSharding, dtypes):
        """A replay entry for a decision that ``_unit_dims`` found to be the sub-mesh's, lifted,
        where the sub-mesh schema's own entry is replayed (its decision holds at every size, and so
        does the lift, which reads placements only); else None (the sub-mesh is asked per miss)."""
        reduced = self._reduced(op_schema)
        sub = self.entries.get(_key(reduced[0], self.propagator)) if reduced is not None else None
        if type(sub) is not tuple:
            return None
        targets = None if result.redistribute_schema is None else result.redistribute_schema.args_spec
        return self._replayable(op_schema, result, targets, dtypes, None if sub[3] is None else SameRoom(op_schema))

    def _known_metas(self, op_schema: OpSchema, metas, dtypes):
        """For a not-replayable key: ``dtypes`` where ``_outputs`` equals PyTorch's metadata, else None."""
        try:
            ours = self._outputs(op_schema, dtypes)
        except Exception:
            return None
        if isinstance(ours, list):
            ours = tuple(ours)
        return dtypes if ours is not None and ours == metas else None

    def _unit_dims(self, op_schema: OpSchema, result: OutputSharding):
        """For a not-replayable key on a mesh with size-1 dims: PyTorch's placements there, where the
        decision on the mesh without them, those placements put back, equals ``result``; else None."""
        reduced = self._reduced(op_schema)
        if reduced is None:
            return None
        units = unit_placements(result, reduced[2])
        try:
            lifted = lift(self._decide(reduced[0]), *reduced, units)
        except Exception:
            return None
        return units if lifted is not None and _same_decision(lifted, result) else None

    def clear(self) -> None:
        self.entries.clear()


class _FastOutputMetadata:
    """Replaces the propagator's ``_propagate_tensor_meta_non_cached`` (the tensor-metadata step of
    PyTorch's miss path, an instance attribute as the miss path itself is) with answers that need no
    FakeTensor run: metadata this cache vouches for (a miss of a key whose metadata it checked
    against PyTorch's once), ``metas.miss_outputs``' arithmetic for mm and embedding, and
    ``metas.kernel_outputs`` (the Meta kernel FakeTensor would run, called directly). Anything else
    goes to the step below it (PyTorch's, or datadep's, which answers fp32 ``_grouped_mm``)."""

    def __init__(self, cache: ShapeFreeCache, below):
        self.cache, self.fallback = cache, below

    def __call__(self, op_schema: OpSchema):
        meta = self.cache.known_outputs(op_schema)
        if meta is None:
            meta = miss_outputs(op_schema)
        if meta is None:
            meta = kernel_outputs(op_schema)
        return meta if meta is not None else self.fallback(op_schema)


def install_shape_free_cache() -> ShapeFreeCache:
    """Put the cache in front of DTensor's miss path (idempotent); returns it (for its counters).
    A cache set aside by ``uninstall_shape_free_cache(keep_learned=True)`` comes back as it was."""
    prop = DTensor._op_dispatcher.sharding_propagator
    with _LOCK:
        if not _INSTALLED:
            cache = _SET_ASIDE.pop() if _SET_ASIDE else ShapeFreeCache(prop)
            # An instance attribute shadows the method for this propagator only; DTensor's C++
            # dispatcher calls it on every miss of its own cache.
            PATCHES.set_attr("dispatch.fast.cache", prop, "propagate_op_sharding_non_cached", cache)
            PATCHES.set_attr("dispatch.fast.cache", prop, "_propagate_tensor_meta_non_cached",
                             _FastOutputMetadata(cache, prop._propagate_tensor_meta_non_cached))
            _INSTALLED.append(cache)
        return _INSTALLED[0]


def uninstall_shape_free_cache(keep_learned: bool = False) -> None:
    """Give DTensor back its own miss path. ``keep_learned``: set the cache aside for the next
    install, for a process that switches between PyTorch's dispatch and vescale's (the benchmarks'
    interleaved arms), so vescale's arm does not start cold after each switch; the default drops it."""
    with _LOCK:
        if _INSTALLED:
            PATCHES.undo("dispatch.fast.cache")
            if keep_learned:
                _SET_ASIDE[:] = _INSTALLED
            _INSTALLED.clear()
        if not keep_learned:
            _SET_ASIDE.clear()


def shape_free_cache() -> ShapeFreeCache | None:
    """The installed cache, or None."""
    return _INSTALLED[0] if _INSTALLED else None
