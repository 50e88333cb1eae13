"""``vescale.dispatch.fast.pick``: DTensor's Replicate -> Shard keeps this rank's chunk by one narrow.

The same bits and layout as PyTorch's chunk-per-rank split, for even, uneven and short dims, and a
cost that does not grow with the mesh dim (counted in Python calls on a 1,024-rank fake world)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

import vescale
from vescale import dispatch
from vescale.dispatch.fast.pick import pick_chunk
from vescale.testing import fake_world


@pytest.mark.parametrize("size,chunks", [(8, 4), (10, 4), (3, 4), (1, 8), (7, 7), (1000, 1024)])
@pytest.mark.parametrize("dim", [0, 1])
def test_pick_is_torch_chunk(size, chunks, dim):
    t = torch.randn(size, 5).transpose(0, 1).contiguous() if dim == 1 else torch.randn(size, 5)
    pieces = list(torch.chunk(t, chunks, dim=dim))
    for index in range(chunks):
        got = pick_chunk(t, dim, chunks, index)
        want = pieces[index] if index < len(pieces) else t.narrow(dim, 0, 0)
        assert got.shape == want.shape and torch.equal(got, want), (size, chunks, index)
        if got.numel():
            assert got.stride() == want.clone().stride()
            assert got.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()  # a copy, as PyTorch's


def _calls_of_a_move(world: int) -> tuple[int, torch.Tensor]:
    """Python and C function calls of one Replicate -> Shard redistribute on a ``world``-rank 1-D fake mesh."""
    with fake_world(world, rank=world - 1):
        mesh = vescale.init_mesh((world,), ("DP",))
        x = DTensor.from_local(torch.arange(3 * world, dtype=torch.float32).view(world, 3), mesh, [Replicate()])
        x.redistribute(mesh, [Shard(0)])  # warm DTensor's caches
        calls = [0]

        def count(frame, event, arg):
            if event in ("call", "c_call"):
                calls[0] += 1

        sys.setprofile(count)
        try:
            out = x.redistribute(mesh, [Shard(0)])
        finally:
            sys.setprofile(None)
        return calls[0], out.to_local()


def test_the_move_costs_the_same_at_any_world_size():
    dispatch.install()
    try:
        small, local_small = _calls_of_a_move(8)
        large, local_large = _calls_of_a_move(1024)
    finally:
        dispatch.uninstall(keep_coverage=True)
    assert torch.equal(local_small, torch.tensor([[21.0, 22.0, 23.0]]))  # the last rank's row
    assert torch.equal(local_large, torch.tensor([[3069.0, 3070.0, 3071.0]]))
    assert large <= small + 5, (small, large)
    # PyTorch's own path visits every chunk: the same move costs more at 1,024 ranks.
    pytorch_small, _ = _calls_of_a_move(8)
    pytorch_large, _ = _calls_of_a_move(1024)
    assert pytorch_large > pytorch_small + 500, (pytorch_small, pytorch_large)
