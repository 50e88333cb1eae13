"""Static Eager's precompiled boundary moves compute what DTensor's redistribution computes.

On 4 real gloo ranks (a 2 x 2 mesh), for every kind of move (a one-collective case or DTensor's
own path), the forward move of a local shard must equal ``redistribute_local_tensor`` with the same
specs, and the gradient a ``Move`` hands back must equal the one DTensor's from_local ->
redistribute -> to_local chain hands back. Values are small integers, so sums in any order are exact
and the comparisons are bitwise (``torch.equal``) even where ranks reduce.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._redistribute import redistribute_local_tensor

import vescale
from vescale.static.boundary import Move, compile_move
from vescale.testing import run_on_ranks

SHAPE = (4, 6, 8)
CASES = [  # (src placements, dst placements, grad placements at dst or None)
    ((Replicate(), Shard(1)), (Replicate(), Replicate()), None),      # all-gather, tensor dim 1
    ((Shard(0), Replicate()), (Replicate(), Replicate()), None),      # all-gather, tensor dim 0
    ((Replicate(), Partial()), (Replicate(), Shard(1)), None),        # reduce-scatter, dim 1
    ((Replicate(), Partial()), (Replicate(), Replicate()), None),     # all-reduce
    ((Replicate(), Replicate()), (Replicate(), Shard(2)), None),      # local chunk
    ((Replicate(), Shard(1)), (Replicate(), Replicate()), (Replicate(), Partial())),  # grad reduce-scattered back
    ((Shard(0), Partial()), (Replicate(), Replicate()), None),        # two mesh dims: DTensor's path
    ((Replicate(), Shard(1)), (Replicate(), Shard(2)), None),         # all-to-all: DTensor's path
    ((Replicate(), Replicate()), (Replicate(), Shard(0)), None),      # Shard(0) of 4 rows on 2 ranks
    ((Replicate(), Replicate()), (Shard(1), Shard(1)), None),         # nested shards: DTensor's path
]


def _global(seed: int) -> torch.Tensor:
    return torch.randint(-8, 8, SHAPE, generator=torch.Generator().manual_seed(seed)).float()


def _local(mesh, placements, seed: int) -> torch.Tensor:
    """This rank's shard of a global tensor; a Partial dim holds a rank-dependent summand whose
    sum over the mesh dim is the same on every rank's view (integers: exact)."""
    full = _global(seed)
    if any(p.is_partial() for p in placements):
        coord = mesh.get_coordinate()
        full = full * (1 + sum(coord)) - _global(seed + 1) * sum(coord)
    d = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    plain = [Replicate() if p.is_partial() else p for p in placements]
    return d.redistribute(mesh, plain).to_local().contiguous()


def _check_cases():
    mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
    failures = []
    for k, (src_p, dst_p, grad_p) in enumerate(CASES):
        x = _local(mesh, src_p, seed=k)
        src = DTensor.from_local(x, mesh, src_p, run_check=False, shape=SHAPE, stride=_global(0).stride())
        dst_spec = DTensor.from_local(x, mesh, src_p, run_check=False, shape=SHAPE, stride=src.stride())._spec
        dst_spec = type(dst_spec)(mesh, dst_p, tensor_meta=src._spec.tensor_meta)
        fn = compile_move(src._spec, dst_spec)
        got = fn(x) if fn is not None else x
        want = redistribute_local_tensor(x, src._spec, dst_spec)
        if not torch.equal(got, want):
            failures.append(f"case {k}: forward differs")

        # Backward: DTensor's chain against the Move, for the same incoming gradient.
        g_place = grad_p or tuple(Replicate() if p.is_partial() else p for p in dst_p)
        g_local = _local(mesh, g_place, seed=100 + k)
        leaf = x.clone().requires_grad_(True)
        chain = DTensor.from_local(leaf, mesh, src_p, run_check=False, shape=SHAPE, stride=src.stride())
        chain.redistribute(mesh, dst_p).to_local(grad_placements=grad_p).backward(g_local)
        leaf2 = x.clone().requires_grad_(True)
        out = Move(src._spec, dst_spec, grad_p)(leaf2)
        if not torch.equal(out.detach(), want):
            failures.append(f"case {k}: Move forward differs")
        out.backward(g_local)
        if not torch.equal(leaf2.grad, leaf.grad):
            failures.append(f"case {k}: backward differs")
    return failures


@pytest.mark.multiproc
def test_moves_match_dtensor_redistribution():
    for rank, failures in enumerate(run_on_ranks(_check_cases, 4)):
        assert not failures, f"rank {rank}: {failures}"


def _count_collectives():
    """A one-mesh-dim move issues exactly one collective (DTensor's path may issue more)."""
    from vescale.debug import CollectiveCounter

    mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
    x = _local(mesh, (Replicate(), Partial()), seed=0)
    src = DTensor.from_local(x, mesh, (Replicate(), Partial()), run_check=False, shape=SHAPE, stride=_global(0).stride())._spec
    dst = type(src)(mesh, (Replicate(), Shard(1)), tensor_meta=src.tensor_meta)
    with CollectiveCounter() as counter:
        compile_move(src, dst)(x)
    return dict(counter.counts)


@pytest.mark.multiproc
def test_one_dim_move_is_one_collective():
    counts = run_on_ranks(_count_collectives, 4)[0]
    assert sum(counts.values()) == 1 and counts.get("reduce_scatter", 0) == 1, counts


def _float_reductions():
    """Reductions of floats whose sums depend on the order (4 ranks on one mesh dim): the moves
    must sum in the order DTensor's collective does. gloo's list-form reduce-scatter sums in another
    order than its single-buffer form from 4 ranks on, so a move that used it here would differ."""
    mesh = vescale.init_mesh((4,), ("TP",))
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 8, 6, generator=g) * 10.0 ** torch.randint(-3, 4, (4, 8, 6), generator=g)
    failures = []
    for dst_p in ((Shard(1),), (Shard(0),), (Shard(2),), (Replicate(),)):
        src = DTensor.from_local(x, mesh, (Partial(),), run_check=False)._spec
        dst = type(src)(mesh, dst_p, tensor_meta=src.tensor_meta)
        if not torch.equal(compile_move(src, dst)(x), redistribute_local_tensor(x, src, dst)):
            failures.append(f"Partial -> {dst_p[0]} differs")
    return failures


@pytest.mark.multiproc
def test_float_reductions_sum_in_dtensors_order():
    for rank, failures in enumerate(run_on_ranks(_float_reductions, 4)):
        assert not failures, f"rank {rank}: {failures}"


def _unit_dim_moves():
    """On TP-only training's (1, 2) mesh, placements on the size-1 DP dim move nothing: a move that
    also changes them is the TP dim's one collective (or none), with DTensor's result."""
    from vescale.debug import CollectiveCounter

    mesh = vescale.init_mesh((1, 2), ("DP", "TP"))
    out = []
    for src_p, dst_p, collectives in (
        ((Shard(0), Shard(1)), (Replicate(), Replicate()), 1),  # all-gather on TP; Shard(0) over one rank is whole
        ((Shard(1), Shard(1)), (Replicate(), Replicate()), 1),  # the same tensor dim on both: not nested over one rank
        ((Partial(), Partial()), (Replicate(), Shard(0)), 1),   # reduce-scatter on TP
        ((Shard(0), Replicate()), (Replicate(), Replicate()), 0),  # nothing moves
    ):
        x = _local(mesh, src_p, seed=len(out))
        src = DTensor.from_local(x, mesh, src_p, run_check=False, shape=SHAPE, stride=_global(0).stride())._spec
        dst = type(src)(mesh, dst_p, tensor_meta=src.tensor_meta)
        move = compile_move(src, dst)
        with CollectiveCounter() as counter:
            got = move(x) if move is not None else x
        want = redistribute_local_tensor(x, src, dst)
        # The one-collective move itself, not DTensor's general path (which moves every changed dim).
        direct = move is None if collectives == 0 else "_single_dim_move" in move.__qualname__
        out.append((src_p, torch.equal(got, want) and direct, counter.total, collectives))
    return out


@pytest.mark.multiproc
def test_moves_on_a_mesh_dim_of_one_rank_are_the_other_dims_moves():
    for src_p, equal, total, want in run_on_ranks(_unit_dim_moves, 2)[0]:
        assert equal and total == want, f"{src_p}: equal and direct {equal}, {total} collectives (want {want})"
