"""vescale.random on real gloo ranks: gathered DTensors equal the single-device tensors bit for bit.

One run_on_ranks call per mesh ((2,), (4,), (2, 2)) sweeps every case of rng_cases over several
shapes (uneven, empty, 1-D to 5-D), placements (Shard on every dim, two shardings of one dim,
_StridedShard, Replicate, Partial with real sum reductions) and dtypes. Every rank also draws the
single-device reference under consistent() and checks its shard, the gathered tensor (full_tensor)
and the generator state after each op; the state stays in step across ops, so each op also checks
that the previous one left the generator exactly where a single device would.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from vescale.mesh import adopt_mesh
import vescale.random as vr
from vescale.testing import run_on_ranks
from rng_cases import CASES, Dist, compare, reference, run_distributed

pytestmark = pytest.mark.multiproc

SHAPES = {1: [(7, 5), (3, 0, 4), (11,)], 2: [(9, 5, 3), (3, 2, 5, 1, 4), (5, 6)]}
PLACEMENTS = {
    (2,): [(Shard(0),), (Shard(1),), (Replicate(),), (Partial(),)],
    (4,): [(Shard(0),), (Shard(1),), (Partial(),)],
    (2, 2): [
        (Shard(0), Shard(0)),
        (Shard(1), Shard(0)),
        (Replicate(), Shard(1)),
        (Partial(), Shard(0)),
        (_StridedShard(0, split_factor=2), Shard(0)),
    ],
}


def _configs(mesh_shape, case):
    """(shape, placements, dtype) triples for one case on one mesh: every placement, dtypes rotating."""
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, *case.int_dtypes]
    i = 0
    for placements in PLACEMENTS[mesh_shape]:
        if (case.factory or not case.partial_ok) and any(p.is_partial() for p in placements):
            continue
        for shape in SHAPES[len(mesh_shape)]:
            if len(shape) < case.min_ndim or any(getattr(p, "dim", -1) >= len(shape) for p in placements):
                continue
            yield shape, placements, dtypes[i % len(dtypes)]
            i += 1


def _sweep(mesh_shape):
    mesh = adopt_mesh(init_device_mesh("cpu", mesh_shape))  # vescale answers for the meshes it is given
    vr.set_device_profile(1, 256)  # 256 virtual threads: threads wrap and later Philox calls are used
    vr.manual_seed(2024)
    failures, checks = [], 0
    for case in CASES:
        for shape, placements, dtype in _configs(mesh_shape, case):
            state = vr.get_state()
            ref, ref_state = reference(case, shape, dtype, state)
            out, out_state = run_distributed(case, Dist(mesh, placements, simulated=False), shape, dtype, state)
            problem = compare(ref, ref_state, out, out_state, mesh, allow_partial=True)
            if problem is None and not isinstance(out, Exception):
                if not all(torch.equal(o.full_tensor(), r) for o, r in zip(out, ref)):
                    problem = "gathered tensor differs from the single-device tensor"
            if problem:
                failures.append(f"{case.name} {dtype} {shape} {placements}: {problem}")
            vr.set_state(out_state)  # the next op starts where this one left the generator
            checks += 1
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, vr.get_state().tolist())
    return {"failures": failures, "checks": checks, "final_states": states}


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=str)
def test_every_op_matches_single_device_on_real_ranks(mesh_shape):
    results = run_on_ranks(_sweep, 4 if mesh_shape != (2,) else 2, mesh_shape, timeout=240)
    for rank, result in enumerate(results):
        assert not result["failures"], f"rank {rank}:\n" + "\n".join(result["failures"])
        assert result["checks"] >= 3 * len(CASES)
    final_states = results[0]["final_states"]
    assert all(state == final_states[0] for state in final_states), final_states


def _seed_with_rank(kind):
    if kind == "profile":
        vr.set_device_profile(100 + dist.get_rank(), 2048)
        seed = 0
    else:
        seed = 1000 + dist.get_rank()
    try:
        vr.manual_seed(seed)
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.parametrize("kind, message", [("seed", "different seeds"), ("profile", "different device profiles")])
def test_ranks_that_disagree_are_told_so(kind, message):
    errors = run_on_ranks(_seed_with_rank, 2, kind, timeout=60)
    assert all(error is not None and message in error for error in errors), errors


def _seed_on_rank_0_only():
    """Rank 0 seeds, rank 1 goes on to build and parallelise (whose weight check is a collective)."""
    import vescale
    from vescale.zoo import llama_plan, tiny_llama

    mesh = vescale.init_mesh((2,), ("TP",), timeout=5)
    try:
        if dist.get_rank() == 0:
            vr.manual_seed(0)
        torch.manual_seed(0)
        model = tiny_llama()
        vescale.parallelize(model, llama_plan(mesh, model.config), mesh)
    except RuntimeError as error:
        return " ".join([str(error), *getattr(error, "__notes__", [])])
    return None


def test_seeding_on_some_ranks_only_is_an_error_on_every_rank():
    """No gloo abort (before: rank 0's seed all-reduce paired with rank 1's weight check, whose
    sizes differ): rank 0 names the rank that did not call manual_seed, and rank 1's timed-out
    collective carries rank 0's report. The collective timeout is 5 s; 120 s bounds a hang."""
    r0, r1 = run_on_ranks(_seed_on_rank_0_only, 2, timeout=120)
    assert r0 is not None and "ranks [1] did not call vescale.manual_seed" in r0, r0
    assert r1 is not None and "rank 0: RuntimeError: vescale.manual_seed: ranks [1] did not call" in r1, r1


def _checkpoint_round_trip(path):
    import torch.distributed.checkpoint as dcp
    import torch.distributed.tensor as dtensor_api

    mesh = adopt_mesh(init_device_mesh("cpu", (2,)))  # vescale answers for the meshes it is given
    vr.manual_seed(7)
    dtensor_api.randn(6, 4, device_mesh=mesh, placements=[Shard(0)])
    dcp.save({"rng": vr.get_state()}, checkpoint_id=path)
    expected = torch.nn.functional.dropout(dtensor_api.ones(6, 4, device_mesh=mesh, placements=[Shard(1)]), 0.5)
    vr.manual_seed(99)  # a different state, to be overwritten by the load
    loaded = {"rng": torch.zeros(4, dtype=torch.int64)}
    dcp.load(loaded, checkpoint_id=path)
    vr.set_state(loaded["rng"])
    again = torch.nn.functional.dropout(dtensor_api.ones(6, 4, device_mesh=mesh, placements=[Shard(1)]), 0.5)
    same_shard = torch.equal(again.to_local(), expected.to_local())
    return same_shard and torch.equal(again.full_tensor(), expected.full_tensor())


def test_state_restored_from_a_distributed_checkpoint_reproduces_the_next_draw(tmp_path):
    assert run_on_ranks(_checkpoint_round_trip, 2, str(tmp_path / "ckpt"), timeout=120) == [True, True]


def _views_of_sharded_tensors():
    from torch.distributed.tensor import distribute_tensor

    results = []
    for mesh_shape, shape, view, placements in [
        ((4,), (4, 8), (32,), [Shard(1)]),  # flattening a sharded inner dim: _StridedShard(0, sf=4)
        ((2, 2), (4, 6), (24,), [Shard(0), Shard(1)]),  # [Shard(0), _StridedShard(0, sf=2)]
        ((2, 2), (6, 4, 2), (6, 8), [Replicate(), Shard(1)]),
    ]:
        mesh = adopt_mesh(init_device_mesh("cpu", mesh_shape))  # vescale answers for the meshes it is given
        vr.manual_seed(3)
        y = distribute_tensor(torch.zeros(shape), mesh, placements).view(view)
        y.normal_()
        vr.manual_seed(3)
        with vr.consistent():
            ref = torch.zeros(view).normal_()
        results.append((str(y.placements), torch.equal(y.full_tensor(), ref)))
    return results


def test_random_op_on_a_view_of_a_sharded_dtensor():
    # View propagation yields _StridedShard placements that are not a shard order; they still hold
    # the right slice.
    for result in run_on_ranks(_views_of_sharded_tensors, 4, timeout=60):
        assert all(equal for _, equal in result), result
        assert "_StridedShard" in result[0][0] and "_StridedShard" in result[1][0]
