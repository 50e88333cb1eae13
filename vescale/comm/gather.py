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
from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from . import direct
from .groups import group_of, group_size
from .layout import NOTHING, gather_plan, pack_gather, unpack_gather

__all__ = ["gather", "GroupGather", "GatherProgram"]


def gather(param: DTensor, mesh: DeviceMesh, placements: Sequence[Placement], stats: collections.Counter | None = None,
           dtype: torch.dtype | None = None) -> DTensor:
    """``param`` (detached) laid out as ``placements``; one all-gather where one is needed.
    ``dtype``: gathered in that dtype (mixed precision: the shard is cast first, so the collective
    moves the compute dtype's bytes)."""
    plan = gather_plan(param.shape, mesh, param.placements, placements)
    with torch.no_grad():
        if plan is None or plan is NOTHING or group_size(mesh, plan.dims) == 1:
            # No collective of ours: DTensor does it (size-1 dims alias the parameter's storage).
            source = param.detach() if dtype is None or dtype == param.dtype else param.detach().to(dtype)
            return source.redistribute(mesh, placements)
        row = pack_gather(_in(param._local_tensor, dtype), plan)
        out = row.new_empty(plan.member_count * plan.row)
        direct.all_gather(out, row, group_of(mesh, plan.dims))
        if stats is not None:
            stats["all_gather"] += 1
        local = unpack_gather(out, plan)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=param.shape, stride=param.stride())


def _in(local: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return local if dtype is None or local.dtype == dtype else local.to(dtype)


class GatherProgram:
    """How one list of ``(parameter, RUN placements)`` is gathered, worked out once and run every
    step: the plan of each parameter, the collectives (one per group of mesh dims) with their
    members' row widths and process groups, the parameters gathered one by one. ``matches`` tells
    whether it still describes a list (the same parameters, specs and placements), so a ZeRO-3 unit
    plans its gathers once instead of once per parameter and step.

    Each parameter joins the collective of the group its own gather needs (a norm weight and a
    row-wise weight need DP only; a column-wise weight too, once its ZeRO shard is nested in its TP
    shard, see ``vescale.placement.nested``), never a wider one: a wider group would move data the
    rank then slices away. Parameters whose gather has no such form (or a size-1 group) are gathered
    one by one, when waited for.
    """

    def __init__(self, items: list[tuple[DTensor, tuple]], mesh: DeviceMesh, dtype_of=None):
        self.mesh = mesh
        self.params = [p for p, _ in items]
        self.specs = [p._spec for p in self.params]
        self.runs = [run for _, run in items]
        # The dtype each parameter is gathered in (mixed precision: the compute dtype, cast before
        # the collective); one collective per group of mesh dims and dtype.
        self.dtypes = [p.dtype if dtype_of is None else dtype_of(p) for p in self.params]
        plans: dict[int, object] = {}
        by_dims: dict[tuple, list[int]] = {}
        for i, (p, run) in enumerate(items):
            t = gather_plan(p.shape, mesh, p.placements, run)
            if t is not None and t is not NOTHING and group_size(mesh, t.dims) > 1:
                plans[i] = t
                by_dims.setdefault((t.dims, self.dtypes[i]), []).append(i)
        self.collectives = [_Program(idx, [plans[i] for i in idx], group_of(mesh, dims), dtype)
                            for (dims, dtype), idx in by_dims.items()]
        self.alone = [i for i in range(len(items)) if i not in plans]

    def matches(self, items: list[tuple[DTensor, tuple]]) -> bool:
        if len(items) != len(self.params):
            return False
        for (p, run), q, spec, want in zip(items, self.params, self.specs, self.runs):
            if p is not q or p._spec is not spec or (run is not want and tuple(run) != tuple(want)):
                return False
        return True


class _Program:
    """One all-gather of the rows of parameters ``idx`` (their plans ``plans``) over ``group``."""

    def __init__(self, idx: list[int], plans: list, group, dtype: torch.dtype):
        self.idx, self.plans, self.group, self.dtype = idx, plans, group, dtype
        self.rows = [t.row for t in plans]
        self.width = sum(self.rows)
        self.members = plans[0].member_count
        # Even rows that are the output block itself (nested ZeRO shards): the gathered (members,
        # row) table is the parameter's RUN shard as it is, so it can be copied straight into place.
        self.in_place = [t.even and t.out == t.base for t in plans]


class GroupGather:
    """The parameters of one unit gathered by one (async) all-gather per group of mesh dims,
    launched now (``program``: a ``GatherProgram`` for ``items``, made here if not given).

    ``wait()`` returns one local tensor per item, each with its own storage (so each can be freed
    on its own); ``wait_into(targets)`` writes them into given tensors instead (ZeRO-3's gathered
    parameters' own storage: straight from the collective's buffer, one copy per unit);
    ``finish()`` only completes the collectives (a gather nobody needed).
    """

    def __init__(self, items: list[tuple[DTensor, tuple]], mesh: DeviceMesh, stats: collections.Counter | None = None,
                 program: GatherProgram | None = None):
        self.items, self.mesh, self.stats = items, mesh, stats
        self.program = program if program is not None else GatherProgram(items, mesh)
        self.collectives = [_Collective(items, c, stats) for c in self.program.collectives]

    @property
    def out_bytes(self) -> int:
        """Bytes of the gathered buffers (in flight or waiting to be unpacked)."""
        return sum(c.out.untyped_storage().nbytes() for c in self.collectives)

    def _alone(self, i: int) -> torch.Tensor:
        p, run = self.items[i]
        return gather(p, self.mesh, run, self.stats, self.program.dtypes[i])._local_tensor

    def wait(self) -> list[torch.Tensor]:
        return self.wait_into([None] * len(self.items))

    def wait_into(self, targets: list) -> list[torch.Tensor]:
        """Write each item's gathered local tensor into ``targets[i]`` (a tensor of its RUN local
        shape), or into a new tensor where ``targets[i]`` is None; returns them."""
        gathered = list(targets)
        for c in self.collectives:
            c.wait_into(gathered)
        for i in self.program.alone:
            x = self._alone(i)
            gathered[i] = x if gathered[i] is None else gathered[i].copy_(x)
        return gathered

    def finish(self) -> None:
        for c in self.collectives:
            c.table()


class _Collective:
    """One all-gather of a ``_Program``, launched now."""

    def __init__(self, items, program: _Program, stats):
        self.program = program
        locals_ = [_in(items[i][0]._local_tensor.detach(), program.dtype) for i in program.idx]
        packed = [pack_gather(t, plan) for t, plan in zip(locals_, program.plans)]
        rows = packed[0] if len(packed) == 1 else torch.cat(packed)  # one parameter: sent as it is
        self.out = rows.new_empty(program.members * program.width)
        self.work = direct.all_gather(self.out, rows, program.group, async_op=True)
        if stats is not None:
            stats["all_gather"] += 1

    def table(self) -> torch.Tensor:
        """The gathered (members, width) table, once the collective has completed."""
        if self.work is not None:
            work, self.work = self.work, None
            direct.wait(work)
        return self.out.view(self.program.members, self.program.width)

    def wait_into(self, gathered: list) -> None:
        """Fill ``gathered[i]`` for this collective's items: copy into the tensor there, or make one."""
        table, prog = self.table(), self.program
        targets = [gathered[i] for i in prog.idx]
        if all(t is not None for t in targets) and all(prog.in_place):
            outs = [t.view(prog.members, row) for t, row in zip(targets, prog.rows)]
            torch.split_with_sizes_copy(table, prog.rows, dim=1, out=outs)
            return
        if len(prog.idx) == 1:  # the buffer is this parameter's own storage: no copy
            fresh = [unpack_gather(table, prog.plans[0])]
        else:
            # One copy per parameter out of the shared buffer (its columns), into its own storage.
            columns = torch.split_with_sizes_copy(table, prog.rows, dim=1)
            fresh = [unpack_gather(rows, t) for rows, t in zip(columns, prog.plans)]
        for i, target, x in zip(prog.idx, targets, fresh):
            gathered[i] = x if target is None else target.copy_(x)
