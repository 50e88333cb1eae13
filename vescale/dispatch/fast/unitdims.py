"""Misses on a mesh with size-1 dims decided on the mesh without them.

TP-only training keeps a ``(1, N)`` mesh (DP of size 1) so that a plan reads the same at any DP
degree. PyTorch's strategy expansion does not know that a size-1 mesh dim is trivial (every
placement on it holds the same local tensor): it prices every combination over both dims, several
times the cost of the same decision on the ``(N,)`` mesh (3-5 ms per ``_grouped_mm`` or ``index``
miss on the MoE benchmark's tp8, ~1 ms on a 1-D mesh).

Why the reduced decision lifts back: PyTorch's redistribution cost is a sum over mesh dims, and on a
size-1 dim every transition costs a constant (latency only: the bandwidth term has no hops) and
scales the bytes of later steps by 1, so the other dims' costs equal the reduced mesh's. The
expanded strategies are the product of per-dim choices (filtered by shardability, which a size-1
dim always passes for non-empty dims), so the cheapest is the cheapest choice per dim, and the
first cheapest in product order pairs the first cheapest per dim. What PyTorch chooses on the
size-1 dims therefore depends on placements only, not on sizes: ``ShapeFreeCache`` takes it from
PyTorch's full answer the first time a key is seen, checks that the reduced decision with those
placements put back equals that answer, and only then decides the key's later misses (new lengths)
on the reduced mesh. A strategy that is not such a product (a handler of its own) simply fails
that check and keeps PyTorch's full path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vescale._torch import DTensorSpec, OpSchema, OutputSharding

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["reducible_mesh", "reduce_schema", "unit_placements", "lift"]

_SUBMESHES: dict = {}  # id(mesh) -> (mesh, its submesh without size-1 dims, their indices)


def reducible_mesh(op_schema: OpSchema) -> tuple | None:
    """``(mesh, submesh, unit dim indices)`` when every DTensor argument lives on one mesh that has
    both size-1 and larger named dims, and each spec's shard order is the one its placements give
    (the reduced spec is rebuilt from placements); else None."""
    specs = _specs((op_schema.args_schema, op_schema.kwargs_schema))
    if not specs:
        return None
    mesh = specs[0].mesh
    if any(s.mesh is not mesh for s in specs):
        return None
    found = _SUBMESHES.get(id(mesh))
    if found is None or found[0] is not mesh:
        found = _SUBMESHES[id(mesh)] = (mesh, *_submesh(mesh))
    if found[1] is None or not all(_default_order(s) for s in specs):
        return None
    return found


def _default_order(spec: DTensorSpec) -> bool:
    """Whether the spec's shard order is the one its constructor derives from its placements."""
    return spec.shard_order is None or spec.shard_order == DTensorSpec.compute_default_shard_order(spec.placements)


def _submesh(mesh):
    names = mesh.mesh_dim_names
    units = tuple(i for i, n in enumerate(mesh.shape) if n == 1)
    if names is None or not units or len(units) == mesh.ndim:
        return None, ()
    try:
        return mesh[tuple(n for i, n in enumerate(names) if i not in units)], units
    except Exception:  # a mesh PyTorch cannot slice so: decided on the full mesh
        return None, ()


def reduce_schema(op_schema: OpSchema, submesh: DeviceMesh, units: tuple[int, ...]) -> OpSchema:
    """The schema with every spec on ``submesh``, its placements on the size-1 dims dropped."""

    def drop(spec: DTensorSpec) -> DTensorSpec:
        return _rebuilt(spec, submesh, tuple(p for i, p in enumerate(spec.placements) if i not in units))

    return OpSchema(op_schema.op, _map(op_schema.args_schema, drop), _map(op_schema.kwargs_schema, drop),
                    schema_info=op_schema.schema_info)


def unit_placements(result: OutputSharding, units: tuple[int, ...]) -> tuple:
    """PyTorch's placements on the size-1 dims: per output spec and per redistribution target,
    in traversal order; None where the answer has no such specs to read."""
    return tuple(tuple(None if s is None else tuple(s.placements[i] for i in units) for s in specs)
                 for specs in _result_specs(result))


def lift(reduced: OutputSharding, asked: OpSchema, original: OpSchema, units: tuple[int, ...],
         placements: tuple) -> OutputSharding | None:
    """The decision ``reduced`` for ``asked`` (``original`` on the mesh without its size-1 dims),
    back on ``original``'s mesh with ``placements`` (``unit_placements``) on the size-1 dims; None
    if its specs do not line up with them. Where only the size-1 dims move inputs, the
    redistribution is ``asked``'s inputs with those placements; where nothing moves, there is none
    (as PyTorch decides)."""
    out_units, target_units = placements
    inputs = _specs((original.args_schema, original.kwargs_schema))
    mesh = inputs[0].mesh
    if reduced.redistribute_schema is None and target_units == tuple(tuple(s.placements[i] for i in units) for s in inputs):
        target_units = ()  # the size-1 dims keep the inputs' placements and nothing else moves
    out_specs, target_specs = _result_specs(reduced)
    if target_units and reduced.redistribute_schema is None:  # built as PyTorch's propagator does
        schema = OpSchema(asked.op, tuple(asked.args_spec), {})
        schema._inplace_rewrap_schema_suggestion(asked)
        reduced = OutputSharding(reduced.output_spec, schema, needs_redistribute=True,
                                 use_val_from_redistribute_schema=reduced.use_val_from_redistribute_schema)
        target_specs = _result_specs(reduced)[1]
    if len(out_specs) != len(out_units) or len(target_specs) != len(target_units):
        return None
    queue = list(out_units)

    def put(spec: DTensorSpec | None) -> Any:
        extra = queue.pop(0)
        if spec is None or extra is None:
            return None if spec is None and extra is None else _NOT_LINED_UP
        full = list(spec.placements)
        for i, p in zip(units, extra):
            full.insert(i, p)
        return _rebuilt(spec, mesh, tuple(full))

    output = _map(reduced.output_spec, put, none_too=True)
    schema = reduced.redistribute_schema
    if schema is not None:
        queue = list(target_units)
        schema = OpSchema(schema.op, _map(schema.args_schema, put), _map(schema.kwargs_schema, put),
                          schema_info=schema.schema_info)
    if _NOT_LINED_UP in _flat(output) or (schema is not None and _NOT_LINED_UP in _flat(
            (schema.args_schema, schema.kwargs_schema))):
        return None
    return OutputSharding(output, schema, needs_redistribute=reduced.needs_redistribute,
                          use_val_from_redistribute_schema=reduced.use_val_from_redistribute_schema)


_NOT_LINED_UP = object()


def _rebuilt(spec: DTensorSpec, mesh, placements) -> DTensorSpec:
    return DTensorSpec(mesh, placements, tensor_meta=spec.tensor_meta,
                       use_strided_shard_as_shard_order=spec.use_strided_shard_as_shard_order)


def _result_specs(result: OutputSharding):
    out = [s for s in _flat(result.output_spec) if s is None or isinstance(s, DTensorSpec)]
    schema = result.redistribute_schema
    targets = [] if schema is None else _specs((schema.args_schema, schema.kwargs_schema))
    return out, targets


def _map(obj, fn, none_too=False):
    """``obj`` with ``fn`` applied to each DTensorSpec (and, ``none_too``, each None: a masked-off
    output) inside tuples, lists and dicts, in traversal order."""
    if isinstance(obj, DTensorSpec) or (none_too and obj is None):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(_map(x, fn, none_too) for x in obj)
    if isinstance(obj, list):
        return [_map(x, fn, none_too) for x in obj]
    if isinstance(obj, dict):
        return {k: _map(v, fn, none_too) for k, v in obj.items()}
    return obj


def _flat(obj) -> list:
    if isinstance(obj, (tuple, list)):
        return [y for x in obj for y in _flat(x)]
    if isinstance(obj, dict):
        return [y for x in obj.values() for y in _flat(x)]
    return [obj]


def _specs(obj) -> list:
    return [x for x in _flat(obj) if isinstance(x, DTensorSpec)]
