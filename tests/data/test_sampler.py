"""``vescale.data``: each data-parallel rank gets exactly its rows of every global batch, over epochs,
with ``drop_last``, and resumes at the exact next batch (one process; meshes on the fake process group).

* The shares of all ranks put together are the global batch, in the order DTensor lays out
  ``Shard(0)`` over the same mesh dims (checked against DTensor's own layout arithmetic), on a 3-D
  mesh with two data-parallel dims; TP peers get the same rows; the dims' order does not matter.
* Epochs: ``set_epoch`` reshuffles from ``seed + epoch``; every row once an epoch; the global mode
  (``mesh=None``) draws the same global batches.
* ``drop_last``: the incomplete batch is dropped, or split if it splits evenly, or refused at
  construction with the numbers and the fix.
* Resume: a sampler (and a DataLoader with prefetching workers) restored from ``state_dict`` —
  through a checkpoint's extras — yields exactly the batches the uninterrupted run had left, also
  on another number of ranks.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import vescale
from vescale.data import DataLoader, GlobalBatchSampler, data_shard
from vescale.testing import fake_world

MESH = ((2, 2, 2), ("DPR", "DPS", "TP"))  # DP-replicate x DP-shard x TP


def _on_every_rank(fn, shape=MESH[0], names=MESH[1]):
    """``fn(mesh)`` as each rank of a fake world of the mesh's size: ``[result of rank 0, ...]``."""
    out = []
    for rank in range(torch.Size(shape).numel()):
        with fake_world(torch.Size(shape).numel(), rank):
            out.append(fn(vescale.init_mesh(shape, names)))
    return out


def test_shares_put_together_are_the_global_batch_in_dtensor_layout():
    batches = list(GlobalBatchSampler(24, 8, shuffle=True, seed=5))  # the global mode: whole batches

    def mine(mesh):
        placements = [Shard(0), Shard(0), Replicate()]
        _, offset = compute_local_shape_and_global_offset((8,), mesh, placements)
        forward = list(GlobalBatchSampler(24, 8, mesh, ("DPR", "DPS"), shuffle=True, seed=5))
        backward = list(GlobalBatchSampler(24, 8, mesh, ("DPS", "DPR"), shuffle=True, seed=5))
        return mesh.get_coordinate(), offset[0], forward, backward, data_shard(mesh, ("DPR", "DPS"))

    ranks = _on_every_rank(mine)
    for coord, offset, forward, backward, (index, count) in ranks:
        assert forward == backward  # dims are taken in mesh order, as DTensor lays them out
        assert count == 4 and index == coord[0] * 2 + coord[1]
        for rows, whole in zip(forward, batches):
            assert rows == whole[offset: offset + 2]  # DTensor's Shard(0) local rows of the global batch
    for i, whole in enumerate(batches):
        by_share = {index: fwd[i] for _, _, fwd, _, (index, _) in ranks}
        assert sum((by_share[k] for k in range(4)), []) == whole
    for a in ranks:  # TP peers: same rows
        for b in ranks:
            if a[0][:2] == b[0][:2]:
                assert a[2] == b[2]


def test_dims_must_name_mesh_dims():
    with pytest.raises(ValueError, match=r"dims \('DP',\) must name distinct dimensions of the mesh, which has \('DPR', 'DPS', 'TP'\)"):
        _on_every_rank(lambda mesh: GlobalBatchSampler(8, 4, mesh, "DP"))
    with pytest.raises(ValueError, match="does not split into 4 shares"):
        _on_every_rank(lambda mesh: GlobalBatchSampler(8, 6, mesh, ("DPR", "DPS")))


def test_epochs_reshuffle_from_seed_and_cover_every_row_once():
    s = GlobalBatchSampler(10, 2, shuffle=True, seed=7)
    first = list(s)
    assert list(s) == first  # no set_epoch: the same order again (DistributedSampler's convention)
    s.set_epoch(1)
    second = list(s)
    assert second != first
    for epoch in (first, second):
        assert sorted(sum(epoch, [])) == list(range(10))
    again = GlobalBatchSampler(10, 2, shuffle=True, seed=7)
    again.set_epoch(1)
    assert list(again) == second
    assert list(GlobalBatchSampler(10, 2)) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]


def test_drop_last_and_uneven_last_batches():
    assert [len(b) for b in GlobalBatchSampler(10, 4)] == [4, 4]  # drop_last=True by default
    assert [len(b) for b in GlobalBatchSampler(10, 4, drop_last=False)] == [4, 4, 2]
    # A last batch of 2 rows splits over 2 shares: each rank gets 1 of it.
    halves = _on_every_rank(lambda mesh: list(GlobalBatchSampler(10, 4, mesh, "DP", drop_last=False)), (2,), ("DP",))
    assert halves == [[[0, 1], [4, 5], [8]], [[2, 3], [6, 7], [9]]]
    with pytest.raises(ValueError, match=r"the dataset's 9 rows leave a last global batch of 1 rows, which does not split into 2 shares.*drop_last=True"):
        _on_every_rank(lambda mesh: GlobalBatchSampler(9, 4, mesh, "DP", drop_last=False), (2,), ("DP",))
    with pytest.raises(ValueError, match="3 rows hold no whole global batch of 4"):
        GlobalBatchSampler(3, 4)


def _take(it, n):
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("taken", [0, 2, 5])
def test_a_resumed_sampler_yields_exactly_the_remaining_batches(taken):
    """Uninterrupted: epochs 0 and 1 of 5 batches. Interrupted after ``taken`` batches of epoch 1,
    resumed from the state through a checkpoint-like round trip: the same batches follow."""
    def sampler():
        return GlobalBatchSampler(20, 4, shuffle=True, seed=1)

    whole = sampler()
    run = list(whole) + (whole.set_epoch(1) or list(whole)) + (whole.set_epoch(2) or list(whole))
    first = sampler()
    list(first)
    first.set_epoch(1)
    done = _take(iter(first), taken)
    state = dict(first.state_dict())  # what goes into a checkpoint's extras
    assert state["epoch"] == 1 and state["batch"] == taken

    resumed = sampler()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # before the pass starts
    resumed.set_epoch(state["epoch"])  # the loop's own set_epoch: keeps the resumed position
    rest = list(resumed)
    resumed.set_epoch(2)
    assert run[5:] == done + rest + list(resumed)


def test_resume_on_another_number_of_ranks_continues_the_global_batches():
    """State is global (epoch, batch): saved on DP=2, resumed on DP=4, the remaining global batches
    are the same rows, split four ways."""
    full = list(GlobalBatchSampler(32, 8, shuffle=True, seed=2))

    def save(mesh):
        s = GlobalBatchSampler(32, 8, mesh, "DP", shuffle=True, seed=2)
        _take(iter(s), 1)
        return s.state_dict()

    state = _on_every_rank(save, (2,), ("DP",))[0]

    def resume(mesh):
        s = GlobalBatchSampler(32, 8, mesh, "DP", shuffle=True, seed=2)
        s.load_state_dict(state)
        return list(s)

    shares = _on_every_rank(resume, (4,), ("DP",))
    for i, whole in enumerate(full[1:]):
        assert sum((shares[k][i] for k in range(4)), []) == whole


def test_load_state_dict_refuses_other_batches():
    state = GlobalBatchSampler(20, 4, shuffle=True, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed saved 1, now 2"):
        GlobalBatchSampler(20, 4, shuffle=True, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="global_batch_size saved 4, now 2"):
        GlobalBatchSampler(20, 2, shuffle=True, seed=1).load_state_dict(state)


class _Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.tensor([i])


def test_dataloader_with_prefetching_workers_resumes_through_a_checkpoint(tmp_path):
    """Two workers fetch batches ahead of the loop; the saved position is the loop's, and a loader
    restored from the checkpoint's extras delivers exactly the batches that were left."""
    def loader():
        return DataLoader(_Rows(), 4, shuffle=True, seed=3, num_workers=2, prefetch_factor=2)

    whole = loader()
    expected = [b.flatten().tolist() for b in whole]
    interrupted, seen = loader(), []
    for batch in interrupted:
        seen.append(batch.flatten().tolist())
        if len(seen) == 2:
            state = interrupted.state_dict()
            break
    assert interrupted.batch_sampler.state_dict()["batch"] > 2  # the workers ran ahead of the loop
    assert state["batch"] == 2
    model = torch.nn.Linear(1, 1)
    vescale.checkpoint.save(tmp_path, model, step=2, data=state)
    resumed = loader()
    resumed.load_state_dict(vescale.checkpoint.load(tmp_path, model)["data"])
    rest = [b.flatten().tolist() for b in resumed]
    assert seen + rest == expected
    assert resumed.state_dict()["batch"] == len(resumed) == 6


def test_a_pass_draws_nothing_from_the_generators_the_model_reads():
    """torch's loader draws a base seed for its workers at every pass; from the default generator,
    that draw would move the generator a single-device run's dropout reads under
    ``vescale.random.consistent()`` (the demo's single-device losses parted from the distributed ones)."""
    data = torch.utils.data.TensorDataset(torch.arange(16))
    loader = vescale.data.DataLoader(data, 4)
    vescale.manual_seed(0)
    before_torch = torch.get_rng_state()
    with vescale.random.consistent():
        expected = torch.rand(8)
    vescale.manual_seed(0)
    with vescale.random.consistent():
        batches = [b for (b,) in loader]
        drawn = torch.rand(8)
    assert torch.equal(drawn, expected), "a pass of the loader moved vescale's generator"
    assert torch.equal(torch.get_rng_state(), before_torch), "a pass of the loader moved torch's default generator"
    assert torch.equal(torch.cat(batches), torch.arange(16))
