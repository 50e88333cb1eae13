"""ZeRO-3 gathers: a parameter from its at-rest (INIT) layout to its RUN layout in one collective.

DTensor's ``redistribute`` gathers one mesh dimension at a time, and a weight sharded on the same
tensor dimension by DP and TP (``(Shard(0), Shard(0))`` -> ``(Replicate(), Shard(0))``) takes it
two collectives plus a re-slice. Here the plan from ``vescale.comm.layout`` makes it one all-gather
over the flattened group of the dimensions involved, then a local slice. The result is a fresh
DTensor leaf (no autograd link to the parameter): its gradient is reduce-scattered by the reducer.
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
    """Several parameters gathered by one (async) all-gather over the union of their groups.

    Parameters whose gather has no such form (or a size-1 group) are gathered one by one, when
    waited for. ``wait()`` returns one local tensor per item, each with its own storage (so each can
    be freed on its own).
    """

    def __init__(self, items: list[tuple[DTensor, tuple]], mesh: DeviceMesh, stats: collections.Counter | None = None):
        self.items, self.mesh, self.stats = items, mesh, stats
        plans = [gather_plan(p.shape, mesh, p.placements, run) for p, run in items]
        grouped = [i for i, t in enumerate(plans) if t is not None and t is not NOTHING and group_size(mesh, t.dims) > 1]
        dims = tuple(sorted({d for i in grouped for d in plans[i].dims}))
        self.plans: dict[int, object] = {}
        for i in grouped:  # every member of one collective uses the same (widest) group
            t = gather_plan(items[i][0].shape, mesh, items[i][0].placements, items[i][1], dims)
            if t is not None:
                self.plans[i] = t
        self.work = self.out = None
        if self.plans:
            rows = torch.cat([pack_gather(items[i][0]._local_tensor.detach(), t) for i, t in self.plans.items()])
            self.width = rows.numel()
            self.out = rows.new_empty(len(next(iter(self.plans.values())).members) * self.width)
            self.work = dist.all_gather_single(self.out, rows, group=group_of(mesh, dims), async_op=True)
            if stats is not None:
                stats["all_gather"] += 1

    def wait(self) -> list[torch.Tensor]:
        if self.work is not None:
            self.work.wait()
        locals_: list[torch.Tensor] = []
        at = 0
        table = self.out.view(-1, self.width) if self.out is not None else None
        for i, (p, run) in enumerate(self.items):
            t = self.plans.get(i)
            if t is None:
                locals_.append(gather(p, self.mesh, run, self.stats)._local_tensor)
                continue
            rows = table[:, at : at + t.row].contiguous()  # a copy: this parameter's own storage
            at += t.row
            locals_.append(unpack_gather(rows, t))
        return locals_
