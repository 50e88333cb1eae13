"""Layout plans (vescale.comm.layout), checked without processes: every rank of a mesh is simulated,
collectives are summed / concatenated by hand, and each rank's result must equal the slice of the
global tensor that DTensor's own layout rules give it (``_compute_local_shape_and_global_offset``).
Exact equality: the simulated sums add the same values in the same order on both sides."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from vescale import InterleavedShard
from vescale.placement.nested import shard_indices
from vescale.comm.layout import (
    NOTHING, _gather_plan, _reduce_plan, pack_gather, pack_rows, unpack_gather, unpack_row,
)

P, R = Partial(), Replicate()


def _local(glob, mesh_shape, coord, placements):
    if any(isinstance(p, InterleavedShard) for p in placements):  # no block: gathered index by index
        for d in range(glob.dim()):
            glob = glob.index_select(d, shard_indices(glob.shape[d], d, mesh_shape, coord, placements))
        return glob
    shape, off = _compute_local_shape_and_global_offset(glob.shape, mesh_shape, list(coord), placements)
    return glob[tuple(slice(o, o + s) for o, s in zip(off, shape))]


def _coords(mesh_shape):
    return list(itertools.product(*(range(s) for s in mesh_shape)))


def _group(coord, dims, mesh_shape):
    """The group's members (row-major over dims) and this coordinate's index among them."""
    members = []
    for vals in itertools.product(*(range(mesh_shape[d]) for d in dims)):
        c = list(coord)
        for d, v in zip(dims, vals):
            c[d] = v
        members.append(tuple(c))
    return members, members.index(tuple(coord))


REDUCE_CASES = [
    ((P, Shard(0)), (Shard(0), Shard(0))),  # ZeRO-3 of a column-parallel weight: nested
    ((P, Shard(1)), (Shard(0), Shard(1))),  # ZeRO-3 of a row-parallel weight
    ((P, P), (Shard(0), R)),  # ZeRO-3 of an SP norm weight
    ((P, P), (R, R)),  # DP x SP: all-reduce over the flattened mesh
    ((P, R), (Shard(0), R)),
    ((R, Shard(0)), (Shard(0), Shard(0))),  # a Replicate gradient: no sum, only a slice
    ((P, Shard(0)), (Shard(1), Shard(0))),
    ((P, R), (Shard(0), Shard(1))),  # a Replicate-on-TP gradient (vocabulary-parallel under SP): sliced first
    ((P, R), (Shard(0), Shard(0))),
]


@pytest.mark.parametrize("shape", [(8, 6), (7, 5)])
@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 3)])
@pytest.mark.parametrize("src,dst", REDUCE_CASES)
def test_reduce_plans_give_each_rank_its_block_of_the_sum(shape, mesh_shape, src, dst):
    gen = torch.Generator().manual_seed(0)
    partial_dims = [i for i, p in enumerate(src) if p.is_partial()]
    # One global-shaped partial value per coordinate of the Partial dims; the true gradient is their sum.
    parts = {k: torch.randn(shape, generator=gen) for k in itertools.product(*(range(mesh_shape[d]) for d in partial_dims))}
    total = sum(parts.values())
    as_local = [R if p.is_partial() else p for p in src]
    locals_ = {c: _local(parts[tuple(c[d] for d in partial_dims)], mesh_shape, c, as_local) for c in _coords(mesh_shape)}
    plans = {c: _reduce_plan(shape, mesh_shape, c, src, dst) for c in _coords(mesh_shape)}
    _check_reduce(plans, locals_, mesh_shape, total, dst)


def _check_reduce(plans, locals_, mesh_shape, total, dst):
    """Simulate each rank's collectives (a reduce-scatter, then its all-reduce over
    ``then_all_reduce``) and compare with the rank's block of ``total``."""
    rows = {c: pack_rows(locals_[c], t) for c, t in plans.items() if t.kind == "reduce_scatter"}
    scattered = {}
    for c, t in plans.items():
        assert t is not None and t is not NOTHING
        members, me = _group(c, t.dims, mesh_shape)
        if t.kind == "all_reduce":
            scattered[c] = sum(locals_[m] for m in members)
        else:
            scattered[c] = unpack_row(sum(rows[m][me] for m in members), t)
    for c, t in plans.items():
        got = sum(scattered[m] for m in _group(c, t.then_all_reduce, mesh_shape)[0])
        torch.testing.assert_close(got, _local(total, mesh_shape, c, dst), rtol=0, atol=1e-6)


@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 3), (3, 2)])
def test_nested_zero_shards_reduce_and_gather_over_dp_alone(mesh_shape):
    """ZeRO shards nested in TP shards (vescale.placement.nested): a column-parallel weight's
    gradient is reduce-scattered, and the weight gathered, over DP (mesh dim 0) alone, with no
    copies (even rows); an SP norm's gradient is reduce-scattered over DP, then all-reduced over TP."""
    dp, tp = mesh_shape
    shape = (dp * tp * 2, 5)
    nested = (InterleavedShard(0, tp), Shard(0))
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(shape, generator=gen) for _ in range(dp)]
    locals_ = {c: _local(parts[c[0]], mesh_shape, c, (R, Shard(0))) for c in _coords(mesh_shape)}
    plans = {c: _reduce_plan(shape, mesh_shape, c, (P, Shard(0)), nested) for c in _coords(mesh_shape)}
    assert {(t.kind, t.dims, t.even, t.then_all_reduce) for t in plans.values()} == {("reduce_scatter", (0,), True, ())}
    _check_reduce(plans, locals_, mesh_shape, sum(parts), nested)
    glob = parts[0]
    gathers = {c: _gather_plan(shape, mesh_shape, c, nested, (R, Shard(0)), None) for c in _coords(mesh_shape)}
    for c, t in gathers.items():
        assert (t.dims, t.even, t.out) == ((0,), True, t.base)  # the gathered rows are the RUN shard
        members, _ = _group(c, t.dims, mesh_shape)
        rows = torch.cat([pack_gather(_local(glob, mesh_shape, m, nested), gathers[m]) for m in members])
        torch.testing.assert_close(unpack_gather(rows, t), _local(glob, mesh_shape, c, (R, Shard(0))), rtol=0, atol=0)
    norm = {c: _reduce_plan((dp * 4,), mesh_shape, c, (P, P), (Shard(0), R)) for c in _coords(mesh_shape)}
    assert {(t.dims, t.then_all_reduce) for t in norm.values()} == {((0,), (1,))}


GATHER_CASES = [
    ((Shard(0), Shard(0)), (R, Shard(0)), None),  # nested: one gather over DP x TP
    ((Shard(0), Shard(1)), (R, Shard(1)), None),  # over DP alone
    ((Shard(0), Shard(1)), (R, Shard(1)), (0, 1)),  # forced onto DP x TP (a unit's shared group)
    ((Shard(0), R), (R, R), (0, 1)),
    ((Shard(1), Shard(0)), (R, R), None),
]


@pytest.mark.parametrize("shape", [(8, 6), (7, 5)])
@pytest.mark.parametrize("mesh_shape", [(2, 2), (3, 2)])
@pytest.mark.parametrize("src,dst,dims", GATHER_CASES)
def test_gather_plans_give_each_rank_its_run_block(shape, mesh_shape, src, dst, dims):
    glob = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    plans = {c: _gather_plan(shape, mesh_shape, c, src, dst, dims) for c in _coords(mesh_shape)}
    for c, t in plans.items():
        assert t is not None and t.kind == "all_gather"
        if dims is not None:
            assert t.dims == dims
        members, _ = _group(c, t.dims, mesh_shape)
        gathered = torch.cat([pack_gather(_local(glob, mesh_shape, m, src), plans[m]) for m in members])
        torch.testing.assert_close(unpack_gather(gathered, t), _local(glob, mesh_shape, c, dst), rtol=0, atol=0)


@pytest.mark.parametrize("mesh_shape", [(2, 2), (3, 2)])
def test_fused_sections_split_on_a_kept_dim_gather_and_reduce_over_dp_alone(mesh_shape):
    """A fused gate|up expert weight (experts, 2 x intermediate, hidden): its ``InterleavedShard`` on
    TP keeps no block, but the ZeRO shard on DP splits another dim (the experts), so the gather and
    the gradient's reduce-scatter are over DP alone on the local tensors (not DTensor's fallback)."""
    dp, tp = mesh_shape
    shape, fused = (dp * 2, 2 * tp * 3, 5), InterleavedShard(1, 2)
    rest, run = (Shard(0), fused), (R, fused)
    glob = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    plans = {c: _gather_plan(shape, mesh_shape, c, rest, run, None) for c in _coords(mesh_shape)}
    for c, t in plans.items():
        assert (t.kind, t.dims, t.even) == ("all_gather", (0,), True)
        members, _ = _group(c, t.dims, mesh_shape)
        rows = torch.cat([pack_gather(_local(glob, mesh_shape, m, rest), plans[m]) for m in members])
        assert torch.equal(unpack_gather(rows, t), _local(glob, mesh_shape, c, run))
    gen = torch.Generator().manual_seed(3)
    parts = [torch.randn(shape, generator=gen) for _ in range(dp)]  # one partial gradient per DP rank
    locals_ = {c: _local(parts[c[0]], mesh_shape, c, run) for c in _coords(mesh_shape)}
    plans = {c: _reduce_plan(shape, mesh_shape, c, (P, fused), rest) for c in _coords(mesh_shape)}
    assert {(t.kind, t.dims) for t in plans.values()} == {("reduce_scatter", (0,))}
    _check_reduce(plans, locals_, mesh_shape, sum(parts), rest)
    # Split along the same dim as the ZeRO shard, the sections are no blocks: DTensor's fallback.
    assert _gather_plan((8, 12), (2, 2), (0, 0), (Shard(1), fused), (R, fused), None) is None


def test_nested_sharding_is_one_group_and_other_layouts_fall_back():
    t = _reduce_plan((8, 4), (2, 2), (0, 1), (P, Shard(0)), (Shard(0), Shard(0)))
    assert (t.kind, t.dims) == ("reduce_scatter", (0, 1))
    t = _reduce_plan((8, 4), (2, 2), (0, 1), (P, Shard(1)), (Shard(0), Shard(1)))
    assert (t.kind, t.dims) == ("reduce_scatter", (0,))
    assert _reduce_plan((8, 4), (2, 2), (0, 0), (P, Shard(0)), (P, Shard(0))) is NOTHING
    assert _reduce_plan((8, 4), (2, 2), (0, 0), (Partial("max"), R), (R, R)) is None  # not a sum
    assert _gather_plan((8, 4), (2, 2), (0, 0), (R, R), (Shard(0), R), None) is None  # a local slice
