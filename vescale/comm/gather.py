"""ZeRO-3 gathers: a parameter from its at-rest (INIT) layout to its RUN layout in one collective.

With ZeRO shards nested in their TP shards (``vescale.placement.nested``, the layout ``parallelize``
gives them), every gather of a unit is one all-gather over DP alone, and the gathered rows are the
rank's RUN shard as they are. For layouts that still shard one tensor dimension by DP outside TP
(``(Shard(0), Shard(0))``, a dim that does not split evenly) the plan from ``vescale.comm.layout``
makes it one all-gather over the flattened group of the dimensions involved, then a local slice,
rather than DTensor's two collectives plus a re-slice. The result is a fresh DTensor leaf (no
autograd link to the parameter): its gradient is reduce-scattered by the reducer.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .groups import group_of, group_size
from .layout import NOTHING, gather_plan, pack_gather, unpack_gather

__all__ = ["gather", "GroupGather"]


def gather(param: DTensor, mesh: DeviceMesh, placements, stats: collections.Counter | None = None) -> DTensor:
    """``param`` (detached) laid out as ``placements``; one all-gather where one is needed."""
    plan = gather_plan(param.shape, mesh, param.placements, placements)
    with torch.no_grad():
        if plan is None or plan is NOTHING or group_size(mesh, plan.dims) == 1:
            # No collective of ours: DTensor does it (size-1 dims alias the parameter's storage).
            return param.detach().redistribute(mesh, placements)
        row = pack_gather(param._local_tensor, plan)
        out = row.new_empty(len(plan.members) * plan.row)
        dist.all_gather_single(out, row, group=group_of(mesh, plan.dims))
        if stats is not None:
            stats["all_gather"] += 1
        local = unpack_gather(out, plan)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=param.shape, stride=param.stride())


class GroupGather:
    """The parameters of one unit gathered by one (async) all-gather per group of mesh dims.

    Each parameter joins the collective of the group its own gather needs (a norm weight and a
    row-wise weight need DP only; a column-wise weight too, once its ZeRO shard is nested in its TP
    shard, see ``vescale.placement.nested``), never a wider one: a wider group would move data the
    rank then slices away. Parameters whose gather has no such form (or a size-1 group) are gathered
    one by one, when waited for. ``wait()`` returns one local tensor per item, each with its own
    storage (so each can be freed on its own).
    """

    def __init__(self, items: list[tuple[DTensor, tuple]], mesh: DeviceMesh, stats: collections.Counter | None = None):
        self.items, self.mesh, self.stats = items, mesh, stats
        self.plans: dict[int, object] = {}
        by_dims: dict[tuple[int, ...], list[int]] = {}
        for i, (p, run) in enumerate(items):
            t = gather_plan(p.shape, mesh, p.placements, run)
            if t is not None and t is not NOTHING and group_size(mesh, t.dims) > 1:
                self.plans[i] = t
                by_dims.setdefault(t.dims, []).append(i)
        self.collectives = [_Collective(items, self.plans, idx, mesh, dims, stats) for dims, idx in by_dims.items()]

    @property
    def out_bytes(self) -> int:
        """Bytes of the gathered buffers (in flight or waiting to be unpacked)."""
        return sum(c.out.untyped_storage().nbytes() for c in self.collectives)

    def wait(self) -> list[torch.Tensor]:
        gathered: dict[int, torch.Tensor] = {}
        for c in self.collectives:
            gathered.update(c.wait())
        return [
            gathered[i] if i in gathered else gather(p, self.mesh, run, self.stats)._local_tensor
            for i, (p, run) in enumerate(self.items)
        ]


class _Collective:
    """One all-gather over mesh dims ``dims`` of the rows of parameters ``idx``, launched now."""

    def __init__(self, items, plans, idx: list[int], mesh: DeviceMesh, dims, stats):
        self.idx, self.plans = idx, [plans[i] for i in idx]
        packed = [pack_gather(items[i][0]._local_tensor.detach(), t) for i, t in zip(idx, self.plans)]
        rows = packed[0] if len(packed) == 1 else torch.cat(packed)  # one parameter: sent as it is
        self.width = rows.numel()
        self.out = rows.new_empty(len(self.plans[0].members) * self.width)
        self.work = dist.all_gather_single(self.out, rows, group=group_of(mesh, dims), async_op=True)
        if stats is not None:
            stats["all_gather"] += 1

    def wait(self) -> dict[int, torch.Tensor]:
        self.work.wait()
        table = self.out.view(-1, self.width)
        if len(self.idx) == 1:  # the buffer is this parameter's own storage: no copy
            return {self.idx[0]: unpack_gather(table, self.plans[0])}
        # One copy per parameter out of the shared buffer (its columns), into its own storage.
        columns = torch.split_with_sizes_copy(table, [t.row for t in self.plans], dim=1)
        return {i: unpack_gather(rows, t) for i, rows, t in zip(self.idx, columns, self.plans)}
