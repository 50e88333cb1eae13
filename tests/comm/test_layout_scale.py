"""Layout plans at any world size: the arithmetic plans of vescale.comm.layout (blocks from
``vescale.placement.blocks``, decisions over every rank taken at representative coordinates) equal
the exhaustive computation they replaced (DTensor's ``_compute_local_shape_and_global_offset`` at
every coordinate of the mesh, every member of every group), across random shapes (uneven, empty
dims), placements (Shard, Replicate, Partial, ``InterleavedShard`` / ``_StridedShard``, nested
ZeRO layouts) and 1-, 2- and 3-D meshes; and plans for a 1,024-rank mesh are made in bounded time."""

from __future__ import annotations

import functools
import itertools
import math
import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _is_shard_like, _StridedShard

from vescale import InterleavedShard
from vescale.comm import layout
from vescale.placement import blocks, nested
from vescale.placement.nested import shard_indices
from vescale.comm.layout import gather_plan, reduce_plan
from vescale.testing import run_on_ranks

P, R = Partial(), Replicate()


# ---- the exhaustive computation the arithmetic replaced (rank by rank, DTensor's own function) ----


def _dtensor_block(shape, mesh_shape, coord, placements):
    s, o = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
    return tuple(s), tuple(o)


def _all_coords(mesh_shape):
    return list(itertools.product(*(range(n) for n in mesh_shape)))


def _exhaustive_blockwise(shape, mesh_shape, placements) -> bool:
    dims = {p.dim for p in placements if _is_shard_like(p)}
    for coord in _all_coords(mesh_shape):
        for d in dims:
            idx = shard_indices(shape[d], d, mesh_shape, coord, placements)
            if idx.numel() > 1 and not bool((idx.diff() == 1).all()):
                return False
    return True


def _exhaustive_fits(kind, shape, mesh_shape, coord, src, dst, dims):
    base = _dtensor_block(shape, mesh_shape, coord, [R if i in dims else src[i] for i in range(len(src))])
    members = tuple(
        _dtensor_block(shape, mesh_shape, c, dst if kind == "reduce_scatter" else src)
        for c in layout._member_coords(coord, mesh_shape, dims)
    )
    own, out = _dtensor_block(shape, mesh_shape, coord, src), _dtensor_block(shape, mesh_shape, coord, dst)
    if not (all(layout._inside(m, base) for m in members) and layout._inside(out, base) and layout._inside(own, base)):
        return None
    (bs, bo), at, even = base, (base[1][0] if base[0] else 0), True
    for s, o in members:
        if tuple(s[1:]) != tuple(bs[1:]) or tuple(o[1:]) != tuple(bo[1:]) or o[0] != at or s != members[0][0]:
            even = False
            break
        at += s[0]
    even = even and bool(bs) and at == bo[0] + bs[0]
    contributes = all(coord[i] == 0 for i in dims if isinstance(src[i], Replicate))
    row = max(math.prod(m[0]) for m in members)
    return layout.Transfer(kind, dims, base, own, out, len(members), row, contributes, even), members


@functools.lru_cache(maxsize=None)
def _exhaustive_group(kind, shape, mesh_shape, src, dst, forced):
    changed = {i for i in range(len(src)) if src[i] != dst[i]}
    if forced is not None and not changed <= set(forced):
        return None
    for dims in ((set(forced),) if forced is not None else (changed, layout._grow(changed, src, dst))):
        dims_t = tuple(sorted(dims))
        if all(_exhaustive_fits(kind, shape, mesh_shape, c, src, dst, dims_t) is not None for c in _all_coords(mesh_shape)):
            return dims_t
    return None


def _exhaustive_plan(kind, shape, mesh_shape, coord, src, dst, forced=None):
    dims = _exhaustive_group(kind, shape, mesh_shape, src, dst, forced)
    return None if dims is None else _exhaustive_fits(kind, shape, mesh_shape, coord, src, dst, dims)


# ---- random cases ----


def _placement(rng, ndim, partial: bool):
    r = rng.random()
    d = rng.randrange(ndim)
    if r < 0.25:
        return R
    if r < 0.45 and partial:
        return P
    if r < 0.8:
        return Shard(d)
    return InterleavedShard(d, rng.choice([2, 3])) if rng.random() < 0.5 else _StridedShard(d, split_factor=rng.choice([2, 4]))


def _case(rng):
    mesh_shape = tuple(rng.choice([1, 2, 2, 3, 4]) for _ in range(rng.choice([1, 2, 2, 3])))
    ndim = rng.choice([1, 2, 2, 3])
    shape = tuple(rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24]) for _ in range(ndim))
    return mesh_shape, shape


def _layout_cases(n, seed):
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        mesh_shape, shape = _case(rng)
        out.append((shape, mesh_shape, tuple(_placement(rng, len(shape), False) for _ in mesh_shape)))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_local_block_is_dtensors_at_every_coordinate(seed):
    for shape, mesh_shape, pl in _layout_cases(150, seed):
        for c in _all_coords(mesh_shape):
            assert blocks.local_block(shape, mesh_shape, c, pl) == _dtensor_block(shape, mesh_shape, c, pl), (shape, mesh_shape, c, pl)


@pytest.mark.parametrize("seed", range(2))
def test_dim_ranges_are_dtensors_indices_in_local_order(seed):
    """The whole index sequence, not only the first offset: what vescale.random draws at."""
    for shape, mesh_shape, pl in _layout_cases(150, 50 + seed):
        for c in _all_coords(mesh_shape):
            for d in range(len(shape)):
                ranges = blocks.dim_ranges(shape[d], d, mesh_shape, c, pl)
                got = [i for s, n in ranges for i in range(s, s + n)]
                assert got == shard_indices(shape[d], d, mesh_shape, c, pl).tolist(), (shape, mesh_shape, c, pl, d)


@pytest.mark.parametrize("seed", range(4))
def test_blockwise_at_representatives_equals_rank_by_rank(seed):
    rng = random.Random(100 + seed)
    cases = _layout_cases(200, 100 + seed)
    # Strided-heavy layouts too: nested ZeRO shards (blocks) next to fused sections (not blocks).
    for _ in range(200):
        mesh_shape = tuple(rng.choice([2, 3, 4]) for _ in range(rng.choice([2, 3])))
        n = math.prod(mesh_shape) * rng.choice([1, 2, 3]) + rng.choice([0, 0, 1, 2])
        pl = tuple(rng.choice([Shard(0), InterleavedShard(0, rng.choice([2, 3, 4])), R]) for _ in mesh_shape)
        cases.append(((n, 3), mesh_shape, pl))
    found = set()
    for shape, mesh_shape, pl in cases:
        want = _exhaustive_blockwise(shape, mesh_shape, pl)
        assert nested.blockwise(shape, mesh_shape, pl) == want, (shape, mesh_shape, pl)
        found.add(want)
    assert found == {True, False}


def _plan_cases(n, seed):
    """(kind, shape, mesh_shape, src, dst, forced): gradients (Partial sources) to parameter layouts,
    and at-rest layouts to RUN layouts, random and ZeRO-shaped (nested, uneven)."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        mesh_shape, shape = _case(rng)
        ndim = len(shape)
        dst = tuple(_placement(rng, ndim, False) for _ in mesh_shape)
        if rng.random() < 0.5:  # a gradient: Partial where the parameter is sharded or replicated
            src = tuple(P if rng.random() < 0.6 else (p if rng.random() < 0.5 else R) for p in dst)
            out.append(("reduce", shape, mesh_shape, src, dst, None))
        else:  # a ZeRO gather: some shards become Replicate (or the RUN layout of a nested shard)
            src = dst
            dst = tuple(R if _is_shard_like(p) and rng.random() < 0.6 else p for p in src)
            forced = None
            if rng.random() < 0.3:
                changed = [i for i in range(len(src)) if src[i] != dst[i]]
                forced = tuple(sorted(set(changed) | {i for i in range(len(src)) if rng.random() < 0.5}))
            out.append(("gather", shape, mesh_shape, src, dst, forced))
    for dp, tp in [(2, 2), (3, 2), (2, 4), (4, 2), (3, 3)]:  # the zoo's ZeRO-3 layouts, even and not
        for n in (dp * tp * 2, dp * tp * 2 + 1, dp * 3, 5):
            nested_src = nested.nest_zero_shards((Shard(0), Shard(0)), (R, Shard(0)), (n, 4), (dp, tp))
            out += [
                ("gather", (n, 4), (dp, tp), nested_src, (R, Shard(0)), None),
                ("reduce", (n, 4), (dp, tp), (P, Shard(0)), nested_src, None),
                ("gather", (n, 4), (dp, tp), (Shard(0), Shard(1)), (R, Shard(1)), (0, 1)),
                ("reduce", (n,), (dp, tp), (P, P), (Shard(0), R), None),
                ("reduce", (n, 6), (dp, tp), (P, R), (Shard(0), Shard(1)), None),
                ("gather", (dp * 2, 2 * tp * 3, n), (dp, tp), (Shard(0), InterleavedShard(1, 2)), (R, InterleavedShard(1, 2)), None),
                ("reduce", (n, 4, 6), (2, dp, tp), (P, P, Shard(2)), (R, Shard(0), Shard(2)), None),
                ("gather", (n, 4, 6), (2, dp, tp), (R, Shard(0), Shard(2)), (R, R, Shard(2)), None),
            ]
    return out


def _key(t):
    return t.kind, t.dims, t.base, t.out  # the same before and after dataclasses.replace(held=, then_all_reduce=)


def _reference(kind, shape, mesh_shape, coord, src, dst, forced, monkeypatch):
    """The plan the exhaustive primitives give, through the same top-level code."""
    members = {}

    def plan(kind, shape, mesh_shape, coord, src, dst, forced=None):
        found = _exhaustive_plan(kind, shape, mesh_shape, coord, src, dst, forced)
        if found is None:
            return None
        members[_key(found[0])] = found[1]
        return found[0]

    with monkeypatch.context() as m:
        m.setattr(layout, "_plan", plan)
        m.setattr(layout, "_block", _dtensor_block)
        m.setattr(layout, "blockwise", _exhaustive_blockwise)
        if kind == "reduce":
            t = layout._reduce_plan.__wrapped__(shape, mesh_shape, coord, src, dst)
        else:
            t = layout._gather_plan.__wrapped__(shape, mesh_shape, coord, src, dst, forced)
    return t, members


@pytest.mark.parametrize("seed", range(6))
def test_plans_equal_the_exhaustive_computation(seed, monkeypatch):
    kinds = set()
    for kind, shape, mesh_shape, src, dst, forced in _plan_cases(60, seed):
        for coord in _all_coords(mesh_shape):
            want, members = _reference(kind, shape, mesh_shape, coord, src, dst, forced, monkeypatch)
            if kind == "reduce":
                got = layout._reduce_plan(shape, mesh_shape, coord, src, dst)
            else:
                got = layout._gather_plan(shape, mesh_shape, coord, src, dst, forced)
            where = (kind, shape, mesh_shape, coord, src, dst, forced)
            assert got == want, where
            if got is not None and got.kind in ("reduce_scatter", "all_gather"):
                # the member list the uneven packing needs, made lazily, and the dataclass fields above
                assert got.members == members[_key(want)], where
                kinds.add((got.kind, got.even))
    assert {("reduce_scatter", True), ("all_gather", True), ("all_gather", False)} <= kinds


def _local(glob, mesh_shape, coord, placements):
    """The shard of ``glob`` at ``coord`` (index by index: any layout, blocks or not)."""
    for d in range(glob.dim()):
        glob = glob.index_select(d, shard_indices(glob.shape[d], d, mesh_shape, coord, placements))
    return glob


def _group(coord, dims, mesh_shape):
    members = layout._member_coords(coord, mesh_shape, dims)
    return members, members.index(tuple(coord))


@pytest.mark.parametrize("seed", range(3))
def test_random_plans_move_every_rank_its_block(seed):
    """Every rank's collective simulated with the plans' own packing (uneven rows by one masked copy
    or member by member): each rank ends with its block of the reduced / gathered global tensor.
    Integer-valued data, so sums in any order are exact."""
    gen = torch.Generator().manual_seed(seed)
    paths = set()
    for kind, shape, mesh_shape, src, dst, forced in _plan_cases(80, 200 + seed):
        coords = _all_coords(mesh_shape)
        if kind == "reduce":
            plans = {c: layout._reduce_plan(shape, mesh_shape, c, src, dst) for c in coords}
        else:
            plans = {c: layout._gather_plan(shape, mesh_shape, c, src, dst, forced) for c in coords}
        if any(t is None or t is layout.NOTHING for t in plans.values()):
            continue
        if kind == "gather":
            glob = torch.randint(-50, 50, shape, generator=gen).float()
            for c, t in plans.items():
                members, _ = _group(c, t.dims, mesh_shape)
                rows = torch.cat([layout.pack_gather(_local(glob, mesh_shape, m, src), plans[m]) for m in members])
                assert torch.equal(layout.unpack_gather(rows, t), _local(glob, mesh_shape, c, dst)), (shape, mesh_shape, c, src, dst)
                paths.add(("gather", t.even, t.row_lengths is not None))
            continue
        partial = [i for i, p in enumerate(src) if p.is_partial()]
        parts = {k: torch.randint(-50, 50, shape, generator=gen).float()
                 for k in itertools.product(*(range(mesh_shape[d]) for d in partial))}
        total = sum(parts.values())
        as_local = [R if p.is_partial() else p for p in src]
        locals_ = {c: _local(parts[tuple(c[d] for d in partial)], mesh_shape, c, as_local) for c in coords}
        rows = {c: layout.pack_rows(locals_[c], t) for c, t in plans.items() if t.kind == "reduce_scatter"}
        scattered = {}
        for c, t in plans.items():
            members, me = _group(c, t.dims, mesh_shape)
            if t.kind == "all_reduce":
                scattered[c] = sum(locals_[m] for m in members)
            else:
                scattered[c] = layout.unpack_row(sum(rows[m][me] for m in members), t)
                paths.add(("reduce", t.even, t.row_lengths is not None))
        for c, t in plans.items():
            got = sum(scattered[m] for m in _group(c, t.then_all_reduce, mesh_shape)[0])
            assert torch.equal(got, _local(total, mesh_shape, c, dst)), (shape, mesh_shape, c, src, dst)
    # even rows, uneven rows by one masked copy, uneven rows member by member: all taken, both ways
    assert paths == {(k, even, masked) for k in ("gather", "reduce") for even, masked in ((True, True), (False, True), (False, False))}


def test_representatives_do_not_grow_with_the_mesh():
    """A nested ZeRO layout (DP inside TP) and its RUN layout: DP is represented by its first and last
    coordinate whatever its size (TP, whose chunks meet the DP sections' boundaries, by each of its
    8); an even plain layout by the first and last coordinate of each mesh dim."""
    nested_pl = (InterleavedShard(0, 8), Shard(0))
    for dp in (2, 16, 128, 1024):
        coords = blocks.representative_coords((dp * 8 * 4, 128), (dp, 8), [nested_pl, (R, Shard(0))])
        assert sorted(coords) == [(d, t) for d in (0, dp - 1) for t in range(8)]
        coords = blocks.representative_coords((dp * 8 * 4, 128), (dp, 8, 4), [(Shard(0), Shard(1), R), (R, Shard(1), Shard(0))])
        assert sorted(coords) == [(d, t, e) for d in (0, dp - 1) for t in (0, 7) for e in (0, 3)]


def _plans_on_rank_517() -> int:
    from torch.distributed.device_mesh import init_device_mesh

    from vescale.placement import nest_zero_shards
    from vescale.testing import fake_world

    count = 0
    with fake_world(1024, rank=517):
        mesh = init_device_mesh("cpu", (128, 8), mesh_dim_names=("DP", "TP"))
        for shape in [(1024, 256), (1024 + 8, 256), (512, 1024), (1000, 7), (4096,), (7,)]:
            for run in [(R, Shard(0)), (R, Shard(len(shape) - 1)), (R, R)]:
                at_rest = nest_zero_shards((Shard(0),) + run[1:], run, shape, (128, 8))
                grad = tuple(P if p.is_replicate() else p for p in run)
                for t in (gather_plan(shape, mesh, at_rest, run), reduce_plan(shape, mesh, grad, at_rest)):
                    assert t is not None, (shape, at_rest, run)
                    count += 1
    return count


def test_plans_for_a_1024_rank_mesh_take_bounded_time():
    """Rank 517 of 1,024 (DP=128 x TP=8) on the fake process group: ZeRO-3 gather and gradient
    reduce-scatter plans of nested, uneven and replicated layouts. The exhaustive computation took
    minutes here (every coordinate of the mesh, DTensor's function each); the bound is a hang guard,
    far above the ~0.1 s this takes."""
    # In a forked process (its fake world of 1,024 ranks stays out of the test process); the time
    # limit is the hang guard.
    assert run_on_ranks(_plans_on_rank_517, 1, timeout=120) == [36]
