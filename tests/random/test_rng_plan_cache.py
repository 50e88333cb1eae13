"""The per-spec plans that vescale.random caches across calls give the bits a fresh computation gives.

A random op on a DTensor reuses, per (mesh, placements, shard order, global shape, mesh coordinate), the
result specs and the kernel.Block (indices, scans, kernel layout) it computed the first time, and the
kernel reuses launch geometry per (global size, dtype width, profile). These tests draw with the caches
warm and cold over changing shapes, placements, seeds and ranks, check every draw against the
single-device reference, and check that entries that must differ (same shape and other placements,
same spec at another coordinate, another dtype) are not shared.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from vescale.mesh import adopt_mesh
import vescale.random as vr
from vescale.random import dtensor as vr_dtensor, kernel
from vescale.testing import forget_dtensor_caches
from rng_cases import CASES_BY_NAME, Dist, compare, destroy_process_group_if_any, reference, run_distributed

MESH_SHAPE = (2, 2)
CONFIGS = [  # (global shape, placements): several share a shape and differ only in placements
    ((8, 6), (Shard(0), Shard(1))),
    ((8, 6), (Shard(1), Shard(0))),
    ((8, 6), (Replicate(), Shard(0))),
    ((8, 6), (Shard(0), Shard(0))),
    ((8, 6), (_StridedShard(0, split_factor=2), Shard(0))),
    ((5, 3, 4), (Shard(2), Replicate())),
    ((5, 3, 4), (Shard(0), Shard(1))),
]
CASE_NAMES = ["F.dropout", "aten.native_dropout", "Tensor.uniform_", "torch.rand_like", "Tensor.bernoulli_(tensor)",
              "torch.randint_like(low, high)", "dtensor.rand"]


@pytest.fixture(autouse=True)
def _clean():
    destroy_process_group_if_any()
    vr_dtensor.clear_plan_cache()
    yield
    destroy_process_group_if_any()
    forget_dtensor_caches()
    vr_dtensor.clear_plan_cache()


def as_rank(rank: int):
    destroy_process_group_if_any()
    dist.init_process_group("fake", rank=rank, world_size=math.prod(MESH_SHAPE))
    forget_dtensor_caches()
    return adopt_mesh(init_device_mesh("cpu", MESH_SHAPE))  # vescale answers for the meshes it is given


def _state(seed: int, offset: int) -> torch.Tensor:
    return torch.tensor([seed, offset, 1, 256], dtype=torch.int64)  # a tiny profile: threads wrap early


def _locals(result) -> list[torch.Tensor]:
    assert not isinstance(result, Exception), result
    return [r.to_local() for r in result]


@pytest.mark.parametrize("rank", [0, 3])
def test_warm_and_cold_plans_draw_the_single_device_bits(fresh_rng, rank):
    mesh = as_rank(rank)
    # Configs and seeds change from call to call and come back, so warm entries are hit after others
    # were added; every draw is checked against the single-device reference and against a cold draw.
    schedule = list(itertools.product(CONFIGS, [0, 7]))
    schedule = schedule + schedule[::-1]
    for i, ((shape, placements), seed) in enumerate(schedule):
        case = CASES_BY_NAME[CASE_NAMES[i % len(CASE_NAMES)]]
        env = Dist(mesh, placements, simulated=True)
        state = _state(seed, 4 * i)
        ref, ref_state = reference(case, shape, torch.float32, state)
        assert not isinstance(ref, Exception), f"{case.name} {shape}: {ref!r}"
        warm, warm_state = run_distributed(case, env, shape, torch.float32, state)
        problem = compare(ref, ref_state, warm, warm_state, mesh)
        assert problem is None, f"{case.name} {shape} {placements} seed {seed} rank {rank}: {problem}"
        vr_dtensor.clear_plan_cache()
        cold, cold_state = run_distributed(case, env, shape, torch.float32, state)
        assert torch.equal(cold_state, warm_state)
        assert all(torch.equal(a, b) for a, b in zip(_locals(warm), _locals(cold)))


def test_a_spec_seen_again_reuses_its_plan_and_draws_new_numbers(fresh_rng):
    mesh = as_rank(1)
    x = DTensor.from_local(torch.ones(4, 3), mesh, [Shard(0), Shard(1)], run_check=False)
    first, _ = torch.ops.aten.native_dropout(x, 0.5, True)
    second, _ = torch.ops.aten.native_dropout(x, 0.5, True)
    assert vr_dtensor._plan_of(x._spec) is vr_dtensor._plan_of(first._spec)  # one plan: the cache is used
    assert len(vr_dtensor._plans) == 1
    # The generator state is not part of the plan: the second draw is the next single-device draw.
    assert not torch.equal(first.to_local(), second.to_local())
    state = vr.get_state()
    again = torch.rand_like(x)
    vr.set_state(state)
    with vr.consistent():
        ref = torch.rand(8, 6)
    rows, cols = vr_dtensor.local_indices(x._spec)
    assert torch.equal(again.to_local(), ref[rows][:, cols])


def test_same_shape_other_placements_get_their_own_plan():
    mesh = as_rank(2)  # coordinate (1, 0)
    plans = {}
    for placements in [(Shard(0), Shard(1)), (Shard(1), Shard(0)), (Replicate(), Shard(0)), (Shard(0), Shard(0))]:
        spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size((8, 6)), (6, 1), torch.float32))
        plan = vr_dtensor._plan_of(spec)
        expected = vr_dtensor.local_indices(spec)
        assert all(torch.equal(a, b) for a, b in zip(plan.block.dim_indices, expected))
        assert plan.result_spec(torch.float32).placements == placements
        plans[placements] = plan
    blocks = {tuple(tuple(i.tolist()) for i in plan.block.dim_indices) for plan in plans.values()}
    assert len(plans) == 4 and len(blocks) == 4


def test_another_mesh_coordinate_gets_its_own_plan():
    seen = []
    for rank in range(4):
        mesh = as_rank(rank)
        x = DTensor.from_local(torch.empty(4, 3), mesh, [Shard(0), Shard(1)], run_check=False)
        plan = vr_dtensor._plan_of(x._spec)
        expected = vr_dtensor.local_indices(x._spec, mesh.get_coordinate())
        assert all(torch.equal(a, b) for a, b in zip(plan.block.dim_indices, expected))
        seen.append(tuple(tuple(i.tolist()) for i in plan.block.dim_indices))
    assert len(set(seen)) == 4  # the meshes compare equal across ranks; the coordinate keeps them apart
    assert len(vr_dtensor._plans) == 4


def test_the_result_spec_follows_the_dtype_of_each_call(fresh_rng):
    mesh = as_rank(0)
    x = DTensor.from_local(torch.ones(4, 3), mesh, [Shard(0), Replicate()], run_check=False)
    for dtype in (torch.float64, torch.float16, torch.float32):
        out = torch.rand_like(x, dtype=dtype)
        assert out.dtype == dtype and out.to_local().dtype == dtype and out._spec.tensor_meta.dtype == dtype
    out, mask = torch.ops.aten.native_dropout(x.to(torch.bfloat16), 0.5, True)
    assert out._spec.tensor_meta.dtype == torch.bfloat16 and mask._spec.tensor_meta.dtype == torch.bool


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_a_block_reused_across_calls_gives_the_bits_of_index_lists(backend, request):
    if backend == "native":
        request.getfixturevalue("native_kernel")  # skipped only without a C compiler; a failed build fails
    shape, index = (6, 40, 7), [torch.tensor([1, 4, 5]), torch.arange(10, 30), torch.arange(7)]
    block = kernel.Block(shape, index)
    draws = [("uniform", dict(low=0.0, high=1.0), 0, 3), ("normal", dict(mean=0.0, std=1.0), 8, 3),
             ("bernoulli", dict(p=0.3), 12, 2**63 + 5), ("uniform", dict(low=-1.0, high=1.0), 400, 9)]
    for kind, params, offset, seed in draws:
        for reused in (block, index):
            out = torch.empty(3, 20, 7)
            kernel.generate(out, kind, seed=seed, offset=offset, global_shape=shape, dim_indices=reused,
                            profile=kernel.DeviceProfile(1, 256), backend=backend, **params)
            if reused is block:
                from_block = out
        assert torch.equal(from_block, out), (kind, offset, seed)


def _launches_reference(numel, itemsize, unroll, offset, profile):
    """kernel._launches as it was before the launch geometry was cached (computed at the offset)."""
    increment = kernel._grid_stride_increment(numel, unroll, profile)
    if kernel._fits_32bit_indexing(numel, itemsize):
        return [kernel.Launch(0, numel, profile.num_threads(numel), offset // 4)], increment
    launches = []
    for start, size in kernel.split_for_32bit_indexing(numel, itemsize):
        launches.append(kernel.Launch(start, size, profile.num_threads(size), (offset + increment) // 4))
        increment += kernel._grid_stride_increment(size, unroll, profile)
    return launches, increment


@pytest.mark.parametrize("numel, itemsize", [(1000, 4), (2**31 - 1, 1), (2**31 + 12345, 4), (3 * 2**31, 8)])
def test_cached_launch_geometry_shifted_to_the_offset_equals_the_direct_computation(numel, itemsize):
    for profile, unroll, offset in itertools.product([kernel.H100_SXM, kernel.DeviceProfile(1, 256)], [2, 4],
                                                     [0, 4, 2**40 + 8]):
        assert kernel._launches(numel, itemsize, unroll, offset, profile) == _launches_reference(
            numel, itemsize, unroll, offset, profile
        )
