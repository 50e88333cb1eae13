"""vescale.random on DTensors, on a simulated mesh: every rank's shard is its slice of the single-device tensor.

One process plays each rank of the mesh in turn over PyTorch's fake process group (its collectives do not
communicate), draws the random op on DTensors, and compares the local shard bit for bit with the slice
that DTensor's own ``distribute_tensor`` cuts from the tensor drawn under ``consistent()``; the generator
state afterwards must equal the single-device one. Hypothesis sweeps op x dtype x shape (1-D..5-D,
uneven and empty dims) x mesh (2,), (4,), (2, 2) x placements (Shard on any dim, two shardings of one
dim, _StridedShard, Replicate, Partial) x virtual device profile x seed and offset.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
from hypothesis import HealthCheck, given, settings, strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from vescale.mesh import adopt_mesh
import vescale.random as vr
from vescale.random import dtensor as vr_dtensor
from vescale.testing import forget_dtensor_caches
from rng_cases import (
    CASES,
    CASES_BY_NAME,
    DTYPES,
    Dist,
    compare,
    destroy_process_group_if_any,
    reference,
    run_distributed,
)

MESH_SHAPES = [(2,), (4,), (2, 2)]
# The fake process group's all-reduce does not reduce, so ops whose control flow depends on a global
# reduction (trunc_normal_'s rejection loop) run only in the multi-process tests.
SIMULATED_CASES = [case for case in CASES if not case.needs_collectives]
PROFILES = [(1, 256), (2, 512), (132, 2048)]  # tiny ones make threads wrap within small tensors


def _forget_other_ranks():
    # DTensor's caches ignore the rank: entries made as one fake rank would be wrong for the next.
    forget_dtensor_caches()


@pytest.fixture(autouse=True)
def _no_process_group_left():
    destroy_process_group_if_any()
    yield
    destroy_process_group_if_any()
    _forget_other_ranks()


def as_rank(rank: int, mesh_shape) -> object:
    """Become ``rank`` of a fake world of prod(mesh_shape) ranks and return its mesh."""
    destroy_process_group_if_any()
    dist.init_process_group("fake", rank=rank, world_size=math.prod(mesh_shape))
    _forget_other_ranks()
    return adopt_mesh(init_device_mesh("cpu", mesh_shape))  # vescale answers for the meshes it is given


def state_tensor(seed: int, offset: int, profile) -> torch.Tensor:
    seed_bits = seed - (1 << 64) if seed >= 1 << 63 else seed
    return torch.tensor([seed_bits, offset, *profile], dtype=torch.int64)


def check_all_ranks(case, shape, dtype, mesh_shape, placements, state):
    ref, ref_state = reference(case, shape, dtype, state)
    for rank in range(math.prod(mesh_shape)):
        mesh = as_rank(rank, mesh_shape)
        out, out_state = run_distributed(case, Dist(mesh, placements, simulated=True), shape, dtype, state)
        problem = compare(ref, ref_state, out, out_state, mesh)
        assert problem is None, (
            f"{case.name} {dtype} shape={shape} mesh={mesh_shape} {placements} rank {rank}: {problem}"
        )


@st.composite
def scenarios(draw):
    case = draw(st.sampled_from(SIMULATED_CASES))
    ndim = draw(st.integers(case.min_ndim, 5))
    # Mostly small dims (0 included: empty shards and tensors), sometimes one long leading dim so that
    # the tiny profiles' threads wrap (element j and j + T share a thread) and later Philox calls are used.
    dims = draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim))
    if ndim <= 2 and draw(st.booleans()):
        dims[0] = draw(st.integers(100, 1500))
    shape = tuple(dims)
    mesh_shape = draw(st.sampled_from(MESH_SHAPES))
    choices = [Shard(d) for d in range(ndim)] + [Replicate()]
    if case.partial_ok and not case.factory:
        choices.append(Partial())
    placements = [draw(st.sampled_from(choices)) for _ in mesh_shape]
    if len(mesh_shape) == 2 and isinstance(placements[1], Shard) and draw(st.booleans()):
        # right-to-left sharding of one dim (FSDP2 + TP): the first mesh dim strides over the second's shards
        placements[0] = _StridedShard(placements[1].dim, split_factor=mesh_shape[1])
    profile = draw(st.sampled_from(PROFILES))
    state = state_tensor(draw(st.integers(0, (1 << 64) - 1)), 4 * draw(st.integers(0, 1 << 20)), profile)
    dtype = draw(st.sampled_from(DTYPES + list(case.int_dtypes)))
    return case, shape, dtype, mesh_shape, tuple(placements), state


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenarios())
def test_every_rank_holds_its_slice_of_the_single_device_tensor(fresh_rng, scenario):
    check_all_ranks(*scenario)


@pytest.mark.parametrize("case", SIMULATED_CASES, ids=lambda c: c.name)
def test_each_op_on_a_2x2_mesh_with_two_shardings_of_one_dim(fresh_rng, case):
    # Every op at least once on an uneven double sharding, whatever hypothesis draws.
    check_all_ranks(case, (7, 3, 2), torch.float32, (2, 2), (Shard(0), Shard(0)), state_tensor(5, 8, (1, 256)))


_SELECTED_PLACEMENTS = [
    (Shard(1), Partial()),
    (Replicate(), Shard(2)),
    (_StridedShard(0, split_factor=2), Shard(0)),
    (Shard(2), Shard(0)),
]


@pytest.mark.parametrize(
    "case_name, placements",
    [
        (name, placements)
        for name in ["Tensor.bernoulli_(tensor)", "F.dropout", "Tensor.normal_", "dtensor.rand"]
        for placements in _SELECTED_PLACEMENTS
        if not (CASES_BY_NAME[name].factory and any(p.is_partial() for p in placements))  # refused, tested below
    ],
    ids=str,
)
def test_selected_placements(fresh_rng, case_name, placements):
    case = CASES_BY_NAME[case_name]
    check_all_ranks(case, (9, 5, 3), torch.bfloat16, (2, 2), placements, state_tensor(11, 0, (1, 256)))


def test_local_indices_follow_distribute_tensor_for_strided_shards():
    # The indices a rank draws are exactly the arange slice DTensor itself gives that rank.
    for placements in [(_StridedShard(0, split_factor=2), Shard(0)), (Shard(0), Shard(0)), (Shard(1), Shard(0))]:
        for rank in range(4):
            mesh = as_rank(rank, (2, 2))
            grid = torch.arange(11 * 6).reshape(11, 6)
            dt = distribute_tensor(grid, mesh, placements, src_data_rank=None)
            rows, cols = vr_dtensor.local_indices(dt._spec)
            assert torch.equal(grid[rows][:, cols], dt.to_local()), (placements, rank)


def test_in_place_op_on_partial_becomes_replicate(fresh_rng):
    mesh = as_rank(1, (2,))
    x = DTensor.from_local(torch.ones(3, 4), mesh, [Partial()], run_check=False)
    y = x.uniform_()
    assert y is x and x.placements == (Replicate(),)


def test_random_op_on_unseeded_generator_tells_user_to_seed(fresh_rng):
    from vescale.random import generator

    mesh = as_rank(0, (2,))
    x = distribute_tensor(torch.empty(4, 4), mesh, [Shard(0)], src_data_rank=None)
    generator._state.seed = None
    with pytest.raises(RuntimeError, match=r"vescale\.manual_seed"):
        x.normal_()


def test_explicit_generator_on_dtensor_is_refused(fresh_rng):
    mesh = as_rank(0, (2,))
    x = distribute_tensor(torch.empty(4, 4), mesh, [Shard(0)], src_data_rank=None)
    with pytest.raises(ValueError, match="generator"):
        x.uniform_(generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="generator"):
        torch.nn.init.normal_(x, generator=torch.Generator().manual_seed(0))


def test_unsupported_random_op_on_dtensor_raises_instead_of_drawing_rank_local_numbers(fresh_rng):
    mesh = as_rank(0, (2,))
    x = distribute_tensor(torch.empty(4, 4), mesh, [Shard(0)], src_data_rank=None)
    with pytest.raises(NotImplementedError, match="exponential_"):
        x.exponential_()
    with pytest.raises(NotImplementedError, match="normal"):
        torch.normal(x, 1.0)


def test_factory_with_partial_placement_is_refused(fresh_rng):
    import torch.distributed.tensor as dtensor_api

    mesh = as_rank(0, (2,))
    with pytest.raises(ValueError, match="Partial"):
        dtensor_api.rand(4, 4, device_mesh=mesh, placements=[Partial()])


def test_consistent_routes_dtensor_ops_without_install(fresh_rng):
    # Inside consistent() a DTensor op reaches vescale even if the DTensor hooks are not installed.
    mesh = as_rank(1, (2,))
    state = vr.get_state()
    with vr.consistent():
        ref = torch.empty(5, 3).uniform_()
    vr.uninstall()
    vr.set_state(state)
    x = distribute_tensor(torch.empty(5, 3), mesh, [Shard(0)], src_data_rank=None)
    with vr.consistent():
        x.uniform_()
    assert torch.equal(x.to_local(), ref[3:])


def test_uninstall_gives_dtensor_back_its_own_rng(fresh_rng):
    mesh = as_rank(0, (2,))
    vr.uninstall()
    assert not vr.is_installed()
    assert all(op not in DTensor._op_dispatcher._custom_op_handlers for op in vr_dtensor.ops.SUPPORTED)
    state = vr.get_state()
    x = distribute_tensor(torch.empty(4, 4), mesh, [Shard(0)], src_data_rank=None)
    x.uniform_()  # PyTorch's own CPU path: draws from torch's generator, not vescale's
    assert torch.equal(vr.get_state(), state)
    vr.install()
    x.uniform_()
    assert not torch.equal(vr.get_state(), state)
