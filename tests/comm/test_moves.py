"""vescale.comm.moves.redistribute is DTensor's redistribute: the same local result, the same
gradient (values and placements), storage of its own, on 4 real gloo ranks (a 2 x 2 mesh).

Values are small integers, so sums in any order are exact and comparisons are bitwise; the
collectives are counted, so a move that silently did nothing (or DTensor's own path) shows.
"""

from __future__ import annotations

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
        assert moves.redistribute(x, (Replicate(), Shard(0))).to_local().tolist() == [[0.0, 1.0], [2.0, 3.0]]
        assert moves._MOVES and moves._SINGLE
        forget_dtensor_caches()
        assert not moves._MOVES and not moves._SINGLE
