"""``vescale.dispatch.metas.local_shape``: a shard's shape by arithmetic equals DTensor's
``compute_local_shape_and_global_offset`` on every rank of 1-, 2- and 3-D meshes (size-1 dims
included), for even and uneven shards, empty dims and shards some ranks get nothing of; placements
it does not cover (a tensor dim split by two mesh dims, strided shards) answer None.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from vescale.dispatch.metas import local_shape
from vescale.testing import fake_world

MESH_SHAPES = ((8,), (2, 4), (4, 2), (1, 8), (8, 1), (2, 2, 2))


def _case(rng: random.Random, mesh_ndim: int):
    shape = tuple(rng.choice((0, 1, 2, 3, 5, 7, 8, 12, 16)) for _ in range(rng.randint(1, 4)))
    free = list(range(len(shape)))
    rng.shuffle(free)
    placements = []
    for _ in range(mesh_ndim):
        kind = rng.choice("RPSS")
        if kind == "S" and free:
            placements.append(Shard(free.pop()))
        else:
            placements.append(Partial() if kind == "P" else Replicate())
    return shape, tuple(placements)


@pytest.mark.parametrize("rank", [0, 3, 5, 7])
def test_local_shape_is_dtensors_on_every_rank(rank):
    rng = random.Random(rank)
    with fake_world(8, rank):
        for mesh_shape in MESH_SHAPES:
            mesh = DeviceMesh("cpu", torch.arange(math.prod(mesh_shape)).reshape(mesh_shape))
            for _ in range(150):
                shape, placements = _case(rng, len(mesh_shape))
                theirs, _ = compute_local_shape_and_global_offset(shape, mesh, placements, skip_offset=True)
                assert local_shape(shape, mesh, placements) == tuple(theirs), (shape, placements, mesh_shape, rank)


def test_layouts_it_does_not_cover_answer_none():
    with fake_world(8, 5):
        mesh = DeviceMesh("cpu", torch.arange(8).reshape(2, 4))
        assert local_shape((8, 8), mesh, (Shard(0), Shard(0))) is None  # one dim split twice: shard order
        assert local_shape((8, 8), mesh, (Replicate(), _StridedShard(0, split_factor=2))) is None
        assert local_shape((8, 8), mesh, (Shard(0), Shard(1))) == (4, 2)  # rank 5 = coordinate (1, 1)
