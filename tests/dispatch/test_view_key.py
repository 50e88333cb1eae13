"""``vescale.dispatch.fast.viewkey``: a reshape's sharding decision kept per summary of the sizes equals
the view rule's (PyTorch's, as ``viewrule`` corrects it) at every size, errors included.

Random reshapes (flattens, splits, regroupings, ``-1``), random placements (``Shard`` on any dim,
several mesh dims on one dim, ``Partial``, ``Replicate``, some ``_StridedShard``) on 1-, 2- and 3-D
meshes, strict (``view``) and not (``reshape``): each call's decision through the table is compared
with ``viewrule.propagate_view`` (PyTorch's ``propagate_shape_and_sharding``, corrected) over
``view_groups`` computed afresh. The table is
kept across the random cases, so two calls that share a summary but not a PyTorch decision fail.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema
from torch.distributed.tensor._ops._view_ops import view_groups
from torch.distributed.tensor.placement_types import _StridedShard

from vescale.dispatch.fast import viewkey
from vescale.dispatch.fast.viewrule import propagate_view
from vescale.testing import fake_world

aten = torch.ops.aten
MESH_SHAPES = ((4,), (2, 2), (1, 4), (4, 1), (2, 2, 2), (2, 4), (1, 8))
SIZES = (1, 2, 3, 4, 6, 8, 12)


@pytest.fixture(scope="module")
def meshes():
    with fake_world(8):
        yield {s: DeviceMesh("cpu", torch.arange(math.prod(s)).reshape(s)) for s in MESH_SHAPES}


@pytest.fixture(scope="module", autouse=True)
def _one_table():
    viewkey.clear_view_decisions()  # kept across this module's cases on purpose (see module doc)
    yield
    viewkey.clear_view_decisions()


def _schema(mesh, shape, placements, sizes, op):
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    spec = DTensorSpec(mesh, tuple(placements), TensorMeta(torch.Size(shape), stride, torch.float32))
    return OpSchema(op, (spec, list(sizes)), {})


def _pytorchs(shape, placements, sizes, mesh_shape, strict):
    try:
        target, out = propagate_view(placements, shape, view_groups(shape, sizes), mesh_shape, strict)
    except Exception:
        return "raises"
    return tuple(target), tuple(out)


def _ours(schema, rule_fn, strict, mesh_shape):
    try:
        spec = schema.args_schema[0]
        _, target, out = viewkey.decision(schema, rule_fn, strict, mesh_shape, (spec.mesh, spec.placements))
    except ValueError:
        return "raises"
    return target, out


@st.composite
def reshapes(draw):
    """(input shape, output sizes): the input's sizes re-cut into random factors, maybe a -1."""
    shape = tuple(draw(st.lists(st.sampled_from(SIZES), min_size=1, max_size=4)))
    left, sizes = math.prod(shape), []
    while left > 1 and len(sizes) < 5:
        divisors = [d for d in range(2, left + 1) if left % d == 0]
        d = draw(st.sampled_from(divisors))
        sizes.append(d)
        left //= d
    if draw(st.booleans()):  # singleton dims sprinkled in
        sizes.insert(draw(st.integers(0, len(sizes))), 1)
    if not sizes:
        sizes = [1]
    if draw(st.booleans()):
        sizes[draw(st.integers(0, len(sizes) - 1))] = -1
    return shape, tuple(sizes)


@st.composite
def placements_for(draw, ndim, mesh_shape):
    out = []
    for _ in mesh_shape:
        kind = draw(st.sampled_from(("R", "P", "S", "S", "S", "SS")))
        if kind == "R":
            out.append(Replicate())
        elif kind == "P":
            out.append(Partial())
        elif kind == "S":
            out.append(Shard(draw(st.integers(0, ndim - 1))))
        else:
            out.append(_StridedShard(draw(st.integers(0, ndim - 1)), split_factor=draw(st.sampled_from((2, 3)))))
    return out


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_decisions_equal_pytorchs_view_rule_at_every_size(meshes, data):
    mesh_shape = data.draw(st.sampled_from(MESH_SHAPES))
    shape, sizes = data.draw(reshapes())
    placements = data.draw(placements_for(len(shape), mesh_shape))
    strict = data.draw(st.booleans())
    op, rule_fn = (aten.view.default, torch.Tensor.view) if strict else (aten.reshape.default, torch.reshape)
    schema = _schema(meshes[mesh_shape], shape, placements, sizes, op)
    placements = schema.args_schema[0].placements  # as DTensorSpec keeps them
    assert _ours(schema, rule_fn, strict, mesh_shape) == _pytorchs(shape, placements, sizes, mesh_shape, strict), (
        f"{'view' if strict else 'reshape'} {shape} -> {sizes}, {placements} on mesh {mesh_shape}")


def test_a_new_sequence_length_asks_pytorchs_rule_no_more(meshes, monkeypatch):
    """(batch, seq, hidden) -> (batch * seq, hidden), batch on DP and hidden on TP: one rule call
    for the first length, none for later ones, each later decision PyTorch's."""
    calls = []
    real = viewkey._pytorch_decision
    monkeypatch.setattr(viewkey, "_pytorch_decision", lambda *a: calls.append(a) or real(*a))
    mesh, placements = meshes[(2, 4)], [Shard(0), Shard(2)]
    for seq in (64, 72, 80, 136):
        schema = _schema(mesh, (8, seq, 128), placements, (8 * seq, 128), aten.view.default)
        assert _ours(schema, torch.Tensor.view, True, (2, 4)) == _pytorchs(
            (8, seq, 128), placements, (8 * seq, 128), (2, 4), True) == ((Shard(0), Shard(2)), (Shard(0), Shard(1)))
    assert len(calls) == 1


def test_sizes_the_decision_reads_are_kept(meshes):
    """Same groups, other facts: a flatten whose sharded first dim stops dividing the mesh (a strict
    view raises), and a non-first sharded dim whose split factor changes, are decided afresh."""
    mesh = meshes[(2, 2)]
    even = _schema(mesh, (4, 6, 8), [Shard(0), Replicate()], (24, 8), aten.view.default)
    uneven = _schema(mesh, (3, 6, 8), [Shard(0), Replicate()], (18, 8), aten.view.default)
    assert _ours(even, torch.Tensor.view, True, (2, 2)) == ((Shard(0), Replicate()), (Shard(0), Replicate()))
    assert _ours(uneven, torch.Tensor.view, True, (2, 2)) == "raises"
    for batch in (4, 3):
        strided = _schema(mesh, (batch, 6, 8), [Replicate(), Shard(1)], (batch * 6, 8), aten.view.default)
        _, out = _ours(strided, torch.Tensor.view, True, (2, 2))
        assert out[1] == _StridedShard(0, split_factor=batch)


def test_a_strided_shard_input_is_keyed_by_its_sizes(meshes):
    """_StridedShard is not a Shard subclass: a summary that let it pass as unsharded would give
    (12,) -> (6, 2) the decision learned for (4,) -> (2, 2) (it was found that way: hypothesis)."""
    mesh = meshes[(1, 4)]
    placements = (Replicate(), _StridedShard(0, split_factor=2))
    for src, sizes in (((4,), (2, -1)), ((12,), (6, 2))):
        schema = _schema(mesh, src, placements, sizes, aten.reshape.default)
        placed = schema.args_schema[0].placements
        assert _ours(schema, torch.reshape, False, (1, 4)) == _pytorchs(src, placed, sizes, (1, 4), False)
