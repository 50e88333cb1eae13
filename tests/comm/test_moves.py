"""vescale.comm.moves.redistribute is DTensor's redistribute: the same local result, the same
gradient (values and placements), storage of its own, on 4 real gloo ranks (a 2 x 2 mesh).

Values are small integers, so sums in any order are exact and comparisons are bitwise; the
collectives are counted, so a move that silently did nothing (or DTensor's own path) shows.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import vescale
from vescale.comm import moves
from vescale.debug import CollectiveCounter
from vescale.testing import run_on_ranks

SHAPE = (4, 6, 8)
CASES = [  # (src placements, dst placements, placements of the gradient arriving at dst)
    ((Replicate(), Shard(1)), (Replicate(), Replicate()), (Replicate(), Replicate())),  # all-gather
    ((Shard(0), Replicate()), (Replicate(), Replicate()), (Replicate(), Partial())),    # its grad reduce-scattered
    ((Replicate(), Partial()), (Replicate(), Shard(1)), (Replicate(), Shard(1))),       # reduce-scatter
    ((Replicate(), Partial()), (Replicate(), Replicate()), (Replicate(), Replicate())),  # all-reduce
    ((Replicate(), Replicate()), (Replicate(), Shard(0)), (Replicate(), Shard(0))),     # local chunk
    ((Shard(0), Partial()), (Replicate(), Replicate()), (Replicate(), Replicate())),    # DTensor's path
    ((Replicate(), Shard(1)), (Replicate(), Shard(2)), (Replicate(), Shard(2))),        # all-to-all
]


def _ints(seed: int) -> torch.Tensor:
    return torch.randint(-8, 8, SHAPE, generator=torch.Generator().manual_seed(seed)).float()


def _dtensor(mesh, placements, seed: int) -> DTensor:
    """A DTensor of the global integers ``_ints(seed)`` laid out as ``placements`` (a Partial dim
    holds rank-dependent summands)."""
    full = DTensor.from_local(_ints(seed), mesh, [Replicate()] * mesh.ndim, run_check=False)
    plain = full.redistribute(mesh, [Replicate() if p.is_partial() else p for p in placements])
    local = plain.to_local().clone()
    for d, p in enumerate(placements):
        if p.is_partial():  # rank r of that dim adds r: another summand on each rank
            local = local + mesh.get_local_rank(d)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(SHAPE),
                              stride=_ints(0).stride())


def _compare():
    mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
    failures, moved = [], 0
    for k, (src, dst, grad_at) in enumerate(CASES):
        x = _dtensor(mesh, src, k)
        grad = _dtensor(mesh, grad_at, 100 + k)
        a = x.detach().requires_grad_()
        with CollectiveCounter() as ours:
            out = moves.redistribute(a, dst)
            out.backward(grad)
        b = x.detach().requires_grad_()
        with CollectiveCounter() as theirs:
            want = b.redistribute(mesh, dst)
            want.backward(grad)
        checks = {
            "placements": out.placements == want.placements,
            "local": torch.equal(out.to_local(), want.to_local()),
            "own storage": out.to_local().untyped_storage().data_ptr() != a.to_local().untyped_storage().data_ptr(),
            "grad placements": a.grad.placements == b.grad.placements,
            "grad local": torch.equal(a.grad.to_local(), b.grad.to_local()),
            "collectives": ours.counts == theirs.counts,
        }
        moved += ours.total
        failures += [f"{src} -> {dst} (grad {grad_at}): {what}" for what, ok in checks.items() if not ok]
    return failures + ([] if moved >= len(CASES) else [f"only {moved} collectives in all"])


@pytest.mark.multiproc
def test_redistribute_is_dtensors():
    for rank, failures in enumerate(run_on_ranks(_compare, 4)):
        assert not failures, f"rank {rank}: {failures}"


def test_a_partial_target_is_refused_as_dtensor_refuses_it():
    from vescale.testing import fake_world

    with fake_world(4):
        mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
        x = DTensor.from_local(torch.ones(2, 3), mesh, (Replicate(), Replicate()), run_check=False)
        with pytest.raises(RuntimeError, match="redistributing to Partial is for internal use only"):
            moves.redistribute(x, (Replicate(), Partial()))


def test_a_mesh_of_another_rank_gets_moves_of_its_own():
    """Compiled moves hold the process group and coordinates of the mesh they were compiled on, and
    spec equality ignores both: a mesh object of another rank (here the same process simulating
    rank 3, then rank 0) must get moves of its own, and forget_dtensor_caches (run by every rank
    run_on_ranks forks) drops them all."""
    from vescale.testing import fake_world, forget_dtensor_caches

    with fake_world(4, rank=3):
        mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
        x = DTensor.from_local(torch.arange(8.0).reshape(4, 2), mesh, (Replicate(), Replicate()), run_check=False)
        assert moves.redistribute(x, (Replicate(), Shard(0))).to_local().tolist() == [[4.0, 5.0], [6.0, 7.0]]  # TP 1
    with fake_world(4, rank=0):
        mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
        x = DTensor.from_local(torch.arange(8.0).reshape(4, 2), mesh, (Replicate(), Replicate()), run_check=False)
        y = moves.redistribute(x, (Replicate(), Shard(0)))
        assert y.to_local().tolist() == [[0.0, 1.0], [2.0, 3.0]]  # a local pick (no collective) ...
        moves.redistribute(y, (Replicate(), Replicate()))  # ... and a one-collective move
        assert moves._MOVES and moves._SINGLE
        forget_dtensor_caches()
        assert not moves._MOVES and not moves._SINGLE


def test_replicate_to_shard_moves_pick_each_rank_its_piece_by_arithmetic():
    """A move that only shards Replicate mesh dims is a local pick (``moves.local_picks``), not
    DTensor's cut into one chunk per rank: every rank of random 1- to 3-D meshes gets its piece of
    the global tensor (index by index, as DTensor lays it out), uneven, empty, nested and
    ``InterleavedShard`` pieces included. Whether to pick (``picks_everywhere``) is decided alike on
    every rank: where some rank's piece is not inside what it holds (a nested order DTensor must
    redistribute), none picks, or the others would wait in DTensor's collectives."""
    import itertools
    import random

    from vescale import InterleavedShard
    from vescale.placement.nested import shard_indices

    def piece(glob, mesh_shape, coord, placements):
        for d in range(glob.dim()):
            glob = glob.index_select(d, shard_indices(glob.shape[d], d, mesh_shape, coord, placements))
        return glob

    rng = random.Random(0)
    picked = refused = mixed = 0
    for _ in range(300):
        mesh_shape = tuple(rng.choice([1, 2, 3, 4]) for _ in range(rng.choice([1, 2, 3])))
        shape = tuple(rng.choice([1, 2, 4, 5, 6, 8, 12]) for _ in range(rng.choice([1, 2])))
        choices = [Replicate()] + [Shard(d) for d in range(len(shape))] + [InterleavedShard(d, 2) for d in range(len(shape)) if shape[d] % 2 == 0]
        src = tuple(rng.choice(choices) for _ in mesh_shape)
        dst = tuple(rng.choice(choices[1:]) if p == Replicate() and rng.random() < 0.7 else p for p in src)
        glob = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        coords = list(itertools.product(*(range(n) for n in mesh_shape)))
        picks = {c: moves.local_picks(shape, mesh_shape, c, src, dst) for c in coords}
        if not moves.picks_everywhere(shape, mesh_shape, src, dst):
            refused += 1
            mixed += len({picks[c] is None for c in coords}) == 2  # some ranks could pick, others not
            continue
        picked += 1
        for c in coords:
            assert picks[c] is not None, (shape, mesh_shape, c, src, dst)
            got = moves.select(piece(glob, mesh_shape, c, src), picks[c])
            assert torch.equal(got, piece(glob, mesh_shape, c, dst)), (shape, mesh_shape, c, src, dst)
            assert got.is_contiguous()
    assert picked > refused and mixed > 0, (picked, refused, mixed)
