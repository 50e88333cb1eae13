"""Misses on a mesh with a size-1 dim decided on the mesh without it (``vescale.dispatch.fast.unitdims``).

On a ``(DP=1, TP=4)`` mesh, a searched op learned at one length is decided at another on the
``(TP=4,)`` mesh (PyTorch's full-mesh path is not asked) and gives PyTorch's own answer: equal
placements, shapes, strides and local values, and the same decision object. Where the reduction
must not apply (no size-1 dim; a lifted decision that differs from PyTorch's), PyTorch decides.
"""

from __future__ import annotations

import pytest
import torch
import torch.testing._internal.distributed.fake_pg  # noqa: F401
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

import vescale
from vescale import dispatch
from vescale.dispatch.fast import cache as cache_module
from vescale.dispatch.fast import unitdims
from vescale.dispatch.fast.cache import _Missed, _key, _same_decision
from vescale.testing import forget_dtensor_caches

from test_shape_free import _dt, _same, _spec

aten = torch.ops.aten


def _index(m, n):  # tokens split over the size-1 DP dim, gathered by a replicated index (MoE dispatch)
    x = _dt(m, (n, 16), (Shard(0), Replicate()), n)
    idx = DTensor.from_local(torch.arange(n - 1, -1, -1), m, (Replicate(), Replicate()), run_check=False)
    return x[idx]


def _row_parallel_mm(m, n):  # a replicated activation meets a row-split weight: the search slices it
    a = _dt(m, (n, 16), (Shard(0), Replicate()), n)
    w = _dt(m, (16, 8), (Replicate(), Shard(0)), 1)
    return torch.mm(a, w)


def _partial_plus_shard(m, n):  # the search reduce-scatters or all-reduces the Partial operand
    p = DTensor.from_local(torch.ones(n, 8), m, (Replicate(), Partial()), run_check=False)
    s = _dt(m, (n, 8), (Shard(0), Shard(0)), n)
    return p + s


def _grouped_mm(m, n):  # column-parallel experts on tokens routed to 4 groups
    x = _dt(m, (4 * n, 16), (Replicate(), Replicate()), n)
    w = _dt(m, (4, 16, 8), (Replicate(), Shard(2)), 1)
    offs = DTensor.from_local(torch.arange(1, 5, dtype=torch.int32) * n, m, (Replicate(), Replicate()),
                              run_check=False)
    return torch._grouped_mm(x, w, offs=offs)


CASES = {"index": _index, "row-parallel mm": _row_parallel_mm, "partial + shard": _partial_plus_shard,
         "grouped_mm": _grouped_mm}


def _asked_meshes(monkeypatch, cache):
    """The mesh sizes of every schema PyTorch's miss path is asked about from now on."""
    asked = []
    real = cache.fallback

    def fallback(schema):
        asked.append(tuple(schema.args_spec[0].mesh.shape))
        return real(schema)

    monkeypatch.setattr(cache, "fallback", fallback)
    return asked


@pytest.mark.parametrize("case", CASES)
def test_a_miss_at_a_new_length_is_decided_without_the_unit_dim_and_gives_pytorchs_answer(unit_mesh, case, monkeypatch):
    fn = CASES[case]
    forget_dtensor_caches()
    cache = dispatch.shape_free_cache()
    fn(unit_mesh, 8)
    _clear_sharding_prop_cache()
    asked, hits = _asked_meshes(monkeypatch, cache), cache.hits
    ours = fn(unit_mesh, 12)
    # the (1, 4) mesh's search not run; the (4,) mesh's only where its own key is not a hit there
    assert all(shape == (4,) for shape in asked), asked
    assert asked or cache.hits > hits, "decided by neither the sub-mesh's key nor PyTorch's search on it"
    monkeypatch.undo()
    forget_dtensor_caches()
    dispatch.uninstall(keep_coverage=True)
    try:
        theirs = fn(unit_mesh, 12)
    finally:
        dispatch.install()
    _same(ours, theirs)


def _mm_schema(m, n, rows=Replicate()):
    a = _spec(m, (n, 16))
    w = _spec(m, (16, 8))
    a = type(a)(m, (Shard(0), rows), tensor_meta=a.tensor_meta)
    w = type(w)(m, (Replicate(), Shard(0)), tensor_meta=w.tensor_meta)
    return OpSchema(aten.mm.default, (a, w), {})


@pytest.mark.parametrize("n", [8, 12, 20, 4096])
def test_the_lifted_decision_is_pytorchs_at_each_size(unit_mesh, n):
    # rows split on the TP dim too: a sharded operand moves there, so the decision is searched by
    # cost at every size (with the rows replicated it would be a free move, replayed: zerocost.py)
    cache = dispatch.shape_free_cache()
    cache(_mm_schema(unit_mesh, 8, Shard(0)))  # learned
    entry = cache.entries[_key(_mm_schema(unit_mesh, 8, Shard(0)))]
    assert type(entry) is _Missed and entry[1] is not None
    schema = _mm_schema(unit_mesh, n, Shard(0))
    assert _same_decision(cache(schema), cache.fallback(schema))


def test_a_lift_of_a_replayed_sub_mesh_decision_is_replayed_itself(unit_mesh, monkeypatch):
    """The DP-split tokens' gather moves them off the size-1 dim (PyTorch prices that above zero,
    so the full-mesh decision is not kept as such), but on the (4,) mesh it moves nothing and is
    replayed there: its lift is learned as an entry of its own (a hit at a new length, neither
    mesh's search asked), whose answer is PyTorch's (values: the parametrized test above)."""
    forget_dtensor_caches()
    cache = dispatch.shape_free_cache()
    _index(unit_mesh, 8)
    mesh_of = {token: mesh for (mesh, _), token in cache_module._TOKENS.items()}  # keys hold layout tokens
    full = [e for k, e in cache.entries.items() if k[0] == id(aten.index.Tensor) and mesh_of[k[1][0][1]].shape == (1, 4)]
    assert full and all(type(e) is tuple for e in full)
    _clear_sharding_prop_cache()
    asked, hits = _asked_meshes(monkeypatch, cache), cache.hits
    _index(unit_mesh, 12)
    assert not asked and cache.hits > hits


@pytest.mark.parametrize("n", [8, 12, 4096])
def test_a_unit_dim_between_two_others(unit_mesh, n):
    """(DP=2, EP=1, TP=2): the size-1 dim in the middle is dropped and put back in its place."""
    mesh = vescale.init_mesh((2, 1, 2), ("DP", "EP", "TP"))
    a, w = _spec(mesh, (n, 16)), _spec(mesh, (16, 8))
    a = type(a)(mesh, (Shard(0), Shard(0), Replicate()), tensor_meta=a.tensor_meta)
    w = type(w)(mesh, (Replicate(), Replicate(), Shard(0)), tensor_meta=w.tensor_meta)
    schema = OpSchema(aten.mm.default, (a, w), {})
    cache = dispatch.shape_free_cache()
    found = unitdims.reducible_mesh(schema)
    assert found is not None and found[2] == (1,) and found[1].mesh_dim_names == ("DP", "TP")
    result = cache.fallback(schema)
    units = cache._unit_dims(schema, result)
    assert units is not None
    reduced = unitdims.reduce_schema(schema, found[1], found[2])
    assert _same_decision(unitdims.lift(cache.fallback(reduced), reduced, schema, found[2], units), result)


def test_no_reduction_without_a_size_1_dim(mesh):
    assert unitdims.reducible_mesh(_mm_schema(mesh, 8)) is None


def test_a_lifted_decision_that_differs_from_pytorchs_is_not_vouched_for(unit_mesh, monkeypatch):
    cache = dispatch.shape_free_cache()
    schema = _mm_schema(unit_mesh, 24)
    result = cache.fallback(schema)
    assert cache._unit_dims(schema, result) is not None
    real = unitdims.unit_placements

    def wrong(result, units):  # Shard(0) on the size-1 dim where PyTorch chose otherwise
        return tuple(tuple(None if p is None else (Shard(0),) for p in specs) for specs in real(result, units))

    monkeypatch.setattr("vescale.dispatch.fast.cache.unit_placements", wrong)
    assert cache._unit_dims(schema, result) is None


def test_nothing_moves_where_only_the_learned_size_1_placements_would(unit_mesh):
    """A key learned where the sub-mesh moved an input, seen where it moves nothing: the size-1
    dims keep the inputs' placements, so the lifted decision redistributes nothing, as PyTorch's."""
    schema = _mm_schema(unit_mesh, 8)
    found = unitdims.reducible_mesh(schema)
    reduced = unitdims.reduce_schema(schema, found[1], found[2])
    out = type(reduced.args_spec[0])(found[1], (Partial(),), tensor_meta=reduced.args_spec[0].tensor_meta)
    same = ((Shard(0),),), ((Shard(0),), (Replicate(),))  # the inputs' own placements on the DP dim
    lifted = unitdims.lift(OutputSharding(out), reduced, schema, found[2], same)
    assert lifted.redistribute_schema is None and not lifted.needs_redistribute
    assert lifted.output_spec.mesh is unit_mesh and lifted.output_spec.placements == (Shard(0), Partial())
    moved = ((Shard(0),),), ((Replicate(),), (Replicate(),))
    lifted = unitdims.lift(OutputSharding(out), reduced, schema, found[2], moved)
    assert lifted.needs_redistribute and [a.placements for a in lifted.redistribute_schema.args_spec] == [
        (Replicate(), Replicate()), (Replicate(), Shard(0))]
