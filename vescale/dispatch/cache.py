"""A sharding cache that a new sequence length still hits: the paper's light-weight sharding cache.

PyTorch keys its sharding-propagation caches on the full input specs, global shapes included, so a
batch with a new sequence length misses on every op and pays the whole miss path again (a
FakeTensor run per op to learn output shapes, ~1-3 ms, then the strategy). For most ops the
placement decision does not depend on sizes at all: if the inputs already sit in one of the op's
sharding rules, the op runs on the local shards as they are, whatever their length.

``ShapeFreeCache`` sits in front of PyTorch's miss path. It remembers decisions that needed no
redistribution and no rewriting of shape arguments, under a key that keeps what can change the
decision: the op, every non-tensor argument, and per tensor its mesh, placements, dtype, rank and
which dims have size 0 or 1 (broadcasting). On a hit only the output metadata is recomputed, by
running the op on meta-device tensors (tens of microseconds instead of a FakeTensor run).

View-like ops (view, _unsafe_view, reshape, expand) carry sizes in their arguments, and DTensor
rewrites those to local sizes. Their key replaces the size argument by PyTorch's own dim-mapping rule
(``_view_ops.dim_maps``: which input dims are kept, split, flattened or broadcast) and keeps the exact
size of every input dim the rule does more with than pass through; a hit re-derives the local size
arguments with PyTorch's ``_adjust_shape_and_stride_args``.

Every key is verified once: the first time it is seen, the fast answer is computed beside PyTorch's
full one and the key is served only if the two are equal (output specs, metadata and rewritten
arguments). Ops that redistribute their inputs, squeeze and data-dependent ops always go to PyTorch.
"""

from __future__ import annotations

import threading

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor._ops._view_ops import InputDim, dim_maps
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._pytree import tree_map_only

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
_LOCK = threading.Lock()
_INSTALLED: list["ShapeFreeCache"] = []


def _size_class(n: int) -> int:
    return n if n < 2 else 2  # 0 and 1 change broadcasting and shardability; larger sizes do not


def _arg_key(a):
    if isinstance(a, DTensorSpec):
        meta = a.tensor_meta
        return ("T", a.mesh, a.placements, meta.dtype, tuple(_size_class(n) for n in meta.shape))
    if isinstance(a, (list, tuple)):
        return tuple(_arg_key(x) for x in a)
    if isinstance(a, torch.Tensor):  # a plain tensor argument (rare): never shape-free
        raise TypeError
    hash(a)  # raises TypeError for unhashable values: such a schema is not cached
    return a


def _view_key(op_schema: OpSchema):
    """(input spec with pass-through dims abstracted, the dim-mapping rule) for a view-like op."""
    spec, *rest = op_schema.args_schema
    if not isinstance(spec, DTensorSpec) or op_schema.kwargs_schema:
        raise TypeError
    rule = dim_maps[_VIEW_RULES[op_schema.op]](spec, *rest)
    passed = {r.input_dim for r in rule if type(r) is InputDim}
    sizes = tuple(_size_class(n) if d in passed else n for d, n in enumerate(spec.shape))
    return (("T", spec.mesh, spec.placements, spec.tensor_meta.dtype, sizes), repr(rule))


def _key(op_schema: OpSchema):
    try:
        if op_schema.op in _VIEW_RULES:
            return (op_schema.op, _view_key(op_schema))
        args = tuple(_arg_key(a) for a in op_schema.args_schema)
        kwargs = tuple(sorted((k, _arg_key(v)) for k, v in op_schema.kwargs_schema.items()))
    except Exception:  # unhashable arguments, a rule that does not apply, ...: not cached
        return None
    return (op_schema.op, args, kwargs)


def _meta_of(x):
    if isinstance(x, torch.Tensor):
        return TensorMeta(shape=x.shape, stride=x.stride(), dtype=x.dtype)
    if isinstance(x, (tuple, list)):
        return type(x)(_meta_of(i) for i in x)
    return None


def _meta_outputs(op_schema: OpSchema):
    """Output TensorMeta(s) from the op's meta kernel, or None when it has none."""

    def empty(spec: DTensorSpec):
        m = spec.tensor_meta
        return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")

    try:
        args = tree_map_only(DTensorSpec, empty, op_schema.args_schema)
        kwargs = tree_map_only(DTensorSpec, empty, op_schema.kwargs_schema)
        return _meta_of(op_schema.op(*args, **kwargs))
    except Exception:  # no meta kernel, data-dependent output, ...: PyTorch's path decides
        return None


def _output_metas(spec):
    if isinstance(spec, DTensorSpec):
        return spec.tensor_meta
    return tuple(None if s is None else s.tensor_meta for s in spec)  # None marks a masked-off output


def _with_metas(template, metas, mesh):
    """The template's placements with new metadata, on ``mesh``: the op's own mesh object, never
    the one the template was learned on (DeviceMesh equality ignores the rank that built it, so a
    mesh from another process or simulated rank compares equal but holds other coordinates)."""

    def one(spec, meta):
        if spec is None:
            return None
        return DTensorSpec(mesh, spec.placements, tensor_meta=meta,
                           use_strided_shard_as_shard_order=spec.use_strided_shard_as_shard_order)

    if isinstance(template, DTensorSpec):
        return one(template, metas)
    return tuple(one(s, m) for s, m in zip(template, metas))


def _interleaved_output(spec) -> bool:
    specs = spec if isinstance(spec, tuple) else (spec,)
    return any(isinstance(p, _StridedShard) for s in specs if s is not None for p in s.placements)


def _mesh_of(op_schema: OpSchema):
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

    def _kind(self, op_schema: OpSchema, result: OutputSharding) -> str | None:
        """How a decision can be replayed: "plain" (runs on the local shards as they are),
        "rewrite" (the same, with size arguments rewritten to local sizes), or None (never)."""
        prop, op = self.propagator, op_schema.op
        if op in prop.op_to_scalar_shape_adjuster or op in prop.squeeze_op_to_dims_variant:
            return None
        if _interleaved_output(result.output_spec):
            return None  # vescale.dispatch.interleaved's rules compare exact section sizes
        if not result.needs_redistribute:
            return "plain" if result.redistribute_schema is None else None
        if op in _VIEW_RULES and result.use_val_from_redistribute_schema:
            moved = [
                a.placements != b.placements
                for a, b in zip(op_schema.args_schema, result.redistribute_schema.args_schema)
                if isinstance(a, DTensorSpec)
            ]
            return None if any(moved) else "rewrite"
        return None

    def _replay(self, op_schema: OpSchema, template, kind: str) -> OutputSharding | None:
        metas = _meta_outputs(op_schema)
        if metas is None or _output_metas(template) is None:
            return None
        if isinstance(template, tuple) and (not isinstance(metas, tuple) or len(metas) != len(template)):
            return None
        mesh = _mesh_of(op_schema)
        if mesh is None:
            return None
        spec = _with_metas(template, metas, mesh)
        if kind == "plain":
            return OutputSharding(spec)
        local_args = self.propagator._adjust_shape_and_stride_args(metas, op_schema, spec)
        return OutputSharding(spec, local_args, needs_redistribute=True, use_val_from_redistribute_schema=True)

    def __call__(self, op_schema: OpSchema) -> OutputSharding:
        key = _key(op_schema)
        entry = self.entries.get(key) if key is not None else None
        if entry is not None and entry is not _NEVER:
            replayed = self._replay(op_schema, *entry)
            if replayed is not None:
                self.hits += 1
                return replayed
        self.misses += 1
        result = self.fallback(op_schema)
        if key is not None and entry is None:
            self.entries[key] = self._learn(op_schema, result)
        return result

    def _learn(self, op_schema: OpSchema, result: OutputSharding):
        """The entry for a first-seen key: replayable only if replaying gives PyTorch's answer."""
        spec = result.output_spec
        kind = self._kind(op_schema, result)
        if kind is None or spec is None or (not isinstance(spec, DTensorSpec) and not isinstance(spec, tuple)):
            return _NEVER
        try:
            replayed = self._replay(op_schema, spec, kind)
        except Exception:
            return _NEVER
        same = replayed is not None and replayed.output_spec == spec and (
            replayed.redistribute_schema == result.redistribute_schema
        )
        return (spec, kind) if same else _NEVER

    def clear(self) -> None:
        self.entries.clear()


def install_shape_free_cache() -> ShapeFreeCache:
    """Put the cache in front of DTensor's miss path (idempotent); returns it (for its counters)."""
    prop = DTensor._op_dispatcher.sharding_propagator
    with _LOCK:
        if not _INSTALLED:
            cache = ShapeFreeCache(prop)
            # An instance attribute shadows the method for this propagator only; DTensor's C++
            # dispatcher calls it on every miss of its own cache.
            prop.propagate_op_sharding_non_cached = cache
            _INSTALLED.append(cache)
        return _INSTALLED[0]


def uninstall_shape_free_cache() -> None:
    prop = DTensor._op_dispatcher.sharding_propagator
    with _LOCK:
        if _INSTALLED:
            prop.__dict__.pop("propagate_op_sharding_non_cached", None)
            _INSTALLED.clear()


def shape_free_cache() -> ShapeFreeCache | None:
    """The installed cache, or None."""
    return _INSTALLED[0] if _INSTALLED else None
