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

__all__ = ["gather"]


def gather(param: DTensor, mesh: DeviceMesh, placements, stats: collections.Counter | None = None) -> DTensor:
    """``param`` (detached) laid out as ``placements``; one all-gather where one is needed."""
    plan = gather_plan(param.shape, mesh, param.placements, placements)
    with torch.no_grad():
        if plan is None or plan is NOTHING or group_size(mesh, plan.dims) == 1:
            # No collective of ours: DTensor does it (size-1 dims alias the parameter's storage).
            return param.detach().redistribute(mesh, placements)
        row = pack_gather(param._local_tensor, plan)
        out = row.new_empty(len(plan.members) * plan.row)
        dist.all_gather_into_tensor(out, row, group=group_of(mesh, plan.dims))
        if stats is not None:
            stats["all_gather"] += 1
        local = unpack_gather(out, plan)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=param.shape, stride=param.stride())
