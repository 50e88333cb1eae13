"""Per-rank data loading: each data-parallel rank loads only its share of every global batch.

vescale takes a root input in one of two modes (``vescale.parallel.contract``): the *global batch*,
which every rank passes whole and the plan splits (``plan.shard("<in>[input_ids]", Shard(0),
mesh="DP")``), or *this rank's share* of it (``plan.annotate(...)`` instead; the zoo plans'
``local_inputs=True``). At DP = 1,000 the global batch makes every rank read, tokenise or decode
1,000 times its share; the per-rank mode does not, and this module loads the share:

    sampler = vescale.data.GlobalBatchSampler(len(dataset), global_batch_size=32, mesh=mesh, dims="DP",
                                              shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=4)

Global batch ``i`` of an epoch is rows ``order[i*B:(i+1)*B]`` of the dataset (``order`` a permutation
drawn from ``seed + epoch``, or the identity without ``shuffle``), and each rank gets the rows the
plan's ``Shard(0)`` would give it: share ``k`` of ``n`` equal shares, ``k`` this rank's coordinate
over the data-parallel mesh dims ``dims`` (flattened in mesh order, as DTensor lays out a dim split
over several mesh dims), so TP peers get the same rows. The same sampler with ``mesh=None`` yields
the whole global batches, so the per-rank run, the global-batch run and one device see the same
data. ``set_epoch`` reshuffles, and ``state_dict()`` — the epoch and the global batches taken, the
same on every rank — goes into a checkpoint's extras (``vescale.checkpoint.save(..., data=...)``)
for a resumed run to continue with the exact next batch, on any number of ranks.

Tensors used outside the model next to its outputs (a diffusion target) are shares too:
``as_global(target, mesh)`` makes them the global tensor the loss needs.

A ``DataLoader`` with workers draws batches ahead of the training loop, so the sampler's own count
runs ahead of what the loop took: ``vescale.data.DataLoader`` (torch's, with this sampler) counts
the batches it delivered and saves that.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence, Sized, Union

import torch
import torch.utils.data
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["data_shard", "as_global", "GlobalBatchSampler", "DataLoader", "shares_drawn"]

Dims = Union[str, Sequence[str]]

# Per-rank shares handed out by this process's samplers over a mesh. The step check
# (vescale.parallel.faults) compares it across ranks: per-rank shares differ by design, so the
# input fingerprint cannot tell a rank that skipped a batch; the count of batches drawn can.
_SHARES_DRAWN = [0]


def shares_drawn() -> int:
    """How many per-rank shares (batches of ``GlobalBatchSampler`` with a mesh, in any loader) this
    process has drawn: equal on every rank of a run that skips no batch."""
    return _SHARES_DRAWN[0]


def data_shard(mesh: DeviceMesh | None, dims: Dims = "DP") -> tuple[int, int]:
    """``(index, count)``: this rank's share of a global batch split over the mesh dims ``dims``
    (one name or several, e.g. ``("DP_replicate", "DP_shard")`` or ``("DP", "EP")``), flattened in
    mesh order as DTensor splits one tensor dim over several mesh dims; ranks that differ only
    along other dims (TP peers) get the same index. ``mesh=None``: ``(0, 1)``, the whole batch. For
    streaming datasets too, e.g. ``datasets.distributed.split_dataset_by_node(ds, *data_shard(mesh))``
    (rank, world size)."""
    if mesh is None:
        return 0, 1
    names = (dims,) if isinstance(dims, str) else tuple(dims)
    mesh_dims = tuple(mesh.mesh_dim_names or ())
    missing = [d for d in names if d not in mesh_dims]
    if missing or len(set(names)) != len(names):
        raise ValueError(
            f"vescale.data: dims {names!r} must name distinct dimensions of the mesh, which has {mesh_dims}; "
            "give the mesh dims the plan splits the batch over (e.g. 'DP', or ('DP', 'EP') for moe_plan with EP)"
        )
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("vescale.data: this rank is not in the mesh; build the sampler on the ranks of the mesh")
    index, count = 0, 1
    for i in sorted(mesh_dims.index(d) for d in names):  # mesh order, whatever order dims lists them in
        index, count = index * mesh.size(i) + coordinate[i], count * mesh.size(i)
    return index, count


def as_global(share: torch.Tensor, mesh: DeviceMesh, dims: Dims = "DP", dim: int = 0) -> DTensor:
    """The global tensor whose share on this rank is ``share`` (split along ``dim`` over the mesh
    dims ``dims``, as ``GlobalBatchSampler`` loads it): a DTensor, no communication. For per-rank
    tensors used *outside* the model next to its outputs, e.g. a diffusion model's target:

        loss = ((model(x, timestep=t).sample - vescale.data.as_global(target, mesh)) ** 2).mean()

    A plain tensor there would be taken as the global tensor (the same on every rank): a shape
    error, or with one row per rank a silent broadcast. Inputs of the model itself are the plan's
    job (``plan.annotate`` / ``local_inputs=True``)."""
    data_shard(mesh, dims)  # checks the names
    names = (dims,) if isinstance(dims, str) else tuple(dims)
    placements = [Shard(dim) if d in names else Replicate() for d in mesh.mesh_dim_names]
    return DTensor.from_local(share, mesh, placements, run_check=False)


class GlobalBatchSampler(torch.utils.data.Sampler[list[int]]):
    """A batch sampler (``DataLoader(dataset, batch_sampler=...)``) that draws global batches of
    ``global_batch_size`` rows and yields this rank's share of each: the rows the global-batch mode
    would give it (see the module doc).

    ``dataset``: the dataset or its length. ``mesh`` / ``dims``: the mesh and the data-parallel dims
    the plan splits the batch over (``mesh=None``: whole global batches, for one device or the
    global-batch mode). ``shuffle``: a new order each epoch, drawn from ``seed + epoch`` (call
    ``set_epoch`` at the start of each epoch, as with ``DistributedSampler``). ``drop_last``: drop
    the last, incomplete global batch; without it that batch must still split into equal shares
    (checked here, not at the last step).
    """

    def __init__(
        self,
        dataset: Union[Sized, int],
        global_batch_size: int,
        mesh: DeviceMesh | None = None,
        dims: Dims = "DP",
        *,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        size = dataset if isinstance(dataset, int) else len(dataset)
        if not isinstance(global_batch_size, int) or global_batch_size < 1:
            raise ValueError(f"GlobalBatchSampler: global_batch_size must be a positive int, got {global_batch_size!r}")
        self.index, self.count = data_shard(mesh, dims)
        self.per_rank = mesh is not None  # its batches are shares: counted in shares_drawn()
        self.size, self.global_batch_size = size, global_batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        where = f"{self.count} shares (mesh dims {dims!r})"
        if global_batch_size % self.count:
            raise ValueError(
                f"GlobalBatchSampler: a global batch of {global_batch_size} rows does not split into {where}; "
                f"use a multiple of {self.count}"
            )
        last = size % global_batch_size
        if not drop_last and last % self.count:
            raise ValueError(
                f"GlobalBatchSampler: the dataset's {size} rows leave a last global batch of {last} rows, which does "
                f"not split into {where}; pass drop_last=True to drop it, or make the dataset a multiple of {self.count} long"
            )
        if len(self) == 0:
            raise ValueError(
                f"GlobalBatchSampler: {size} rows hold no whole global batch of {global_batch_size} (drop_last=True)"
            )
        self.epoch = 0
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, its order of the rows)
        self._resume: int | None = None  # the batch a resumed epoch starts at (load_state_dict)
        self.started = 0  # the first batch of the pass in progress
        self._next = 0  # the next batch this sampler hands out

    def __len__(self) -> int:
        """Global batches per epoch (each yields this rank's share)."""
        full, last = divmod(self.size, self.global_batch_size)
        return full + (1 if last and not self.drop_last else 0)

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order from the next pass on; a resumed position in another epoch is dropped."""
        if epoch != self.epoch:
            self._resume, self._next = None, 0
        self.epoch = epoch

    def order(self) -> torch.Tensor:
        """This epoch's order of the dataset's rows (the same on every rank; drawn once an epoch)."""
        if self._order is None or self._order[0] != self.epoch:
            rows = torch.arange(self.size) if not self.shuffle else torch.randperm(
                self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
            self._order = (self.epoch, rows)
        return self._order[1]

    def share(self, rows: torch.Tensor) -> list[int]:
        """This rank's equal share of one global batch's rows."""
        each = len(rows) // self.count
        return rows[self.index * each: (self.index + 1) * each].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        # Where the pass starts is decided here, not in the generator: a DataLoader asks for the
        # iterator when its own iterator is made, and vescale.data.DataLoader reads it then. (It may
        # ask twice, so a resumed position is used up only when the pass hands out its first batch.)
        self.started = self._resume if self._resume is not None else 0
        return self._shares(self.order(), self.started)

    def _shares(self, order: torch.Tensor, start: int) -> Iterator[list[int]]:
        self._resume, self._next = None, start
        batch = self.global_batch_size
        for i in range(start, len(self)):
            self._next = i + 1
            _SHARES_DRAWN[0] += self.per_rank
            yield self.share(order[i * batch: (i + 1) * batch])

    def state_dict(self, taken: int | None = None) -> dict:
        """Where to resume: ``{"epoch", "batch"}`` (global batches of that epoch taken: ``taken``, or
        those this sampler handed out) and what fixes the batches (checked on load). The same on
        every rank and independent of the mesh: a run may resume on another number of ranks."""
        batch = taken if taken is not None else self._resume if self._resume is not None else self._next
        return {
            "epoch": self.epoch, "batch": batch, "dataset_size": self.size, "global_batch_size": self.global_batch_size,
            "shuffle": self.shuffle, "seed": self.seed, "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next pass (``set_epoch`` with the saved epoch, or none) starts at the batch after
        the last one taken. The batches must be drawn alike (dataset size, batch size, seed, ...)."""
        differ = {k: (state.get(k), v) for k, v in self.state_dict().items() if k not in ("epoch", "batch") and state.get(k) != v}
        if differ:
            shown = ", ".join(f"{k} saved {a!r}, now {b!r}" for k, (a, b) in differ.items())
            raise ValueError(
                f"GlobalBatchSampler.load_state_dict: the saved position is for other batches ({shown}); build the "
                "sampler as the saved run did to continue it with its next batch"
            )
        if not 0 <= state["batch"] <= len(self):
            raise ValueError(f"GlobalBatchSampler.load_state_dict: batch {state['batch']} is outside an epoch of {len(self)} batches")
        self.epoch, self._resume, self._next = state["epoch"], state["batch"], state["batch"]


class DataLoader(torch.utils.data.DataLoader):
    """``torch.utils.data.DataLoader`` over this rank's share of each global batch
    (``GlobalBatchSampler``'s arguments, then any of torch's: ``num_workers``, ``collate_fn``,
    ``pin_memory``, ...) that knows how many batches the loop took, for an exact resume:

        loader = vescale.data.DataLoader(dataset, 32, mesh, "DP", shuffle=True, num_workers=4)
        for epoch in range(start_epoch, epochs):
            loader.set_epoch(epoch)
            for batch in loader:
                ...
                vescale.checkpoint.save(folder, model, opt, data=loader.state_dict())

    and on restart ``loader.load_state_dict(vescale.checkpoint.load(folder, model, opt)["data"])``.
    """

    def __init__(
        self,
        dataset: torch.utils.data.Dataset,
        global_batch_size: int,
        mesh: DeviceMesh | None = None,
        dims: Dims = "DP",
        *,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = True,
        **kwargs: Any,
    ) -> None:
        taken = sorted(set(kwargs) & {"batch_size", "sampler", "batch_sampler"})
        if taken:
            raise TypeError(f"vescale.data.DataLoader: {taken} are set by the global batch sampler; give global_batch_size")
        sampler = GlobalBatchSampler(dataset, global_batch_size, mesh, dims, shuffle=shuffle, seed=seed, drop_last=drop_last)
        # torch's loader draws a base seed (for its workers) at every pass, from the default
        # generator unless given one: on one device under vescale.random.consistent() that draw
        # would move the generator the model's dropout reads, so the single-device run's masks
        # would no longer be the distributed run's. A generator of the loader's own draws it.
        kwargs.setdefault("generator", torch.Generator().manual_seed(seed))
        super().__init__(dataset, batch_sampler=sampler, **kwargs)
        self._taken: int | None = None  # batches of the epoch the loop took; None: no pass since the last reposition

    def __iter__(self):
        batches = super().__iter__()  # asks the sampler for its iterator: the pass's first batch is known now
        self._taken = self.batch_sampler.started
        return self._counted(batches)

    def _counted(self, batches):
        for batch in batches:
            self._taken += 1
            yield batch

    @property
    def epoch(self) -> int:
        return self.batch_sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.batch_sampler.epoch:
            self._taken = None
        self.batch_sampler.set_epoch(epoch)

    def state_dict(self) -> dict:
        """``GlobalBatchSampler.state_dict`` at the batches this loader delivered (not those its workers fetched ahead)."""
        return self.batch_sampler.state_dict(taken=self._taken)

    def load_state_dict(self, state: dict) -> None:
        self.batch_sampler.load_state_dict(state)
        self._taken = None
