"""Collectives called on the process group itself, with options made once.

``torch.distributed``'s functions wrap each call in torch-function dispatch, argument checks and
logging and coalescing decorators that cost more CPU than the collective itself on the small
buffers of a ZeRO-3 unit or a gradient bucket, and vescale.comm issues several per step. None of it
applies here: contiguous real tensors, a process group of a mesh this rank belongs to, outside any
coalescing block. Complex tensors take the wrappers (they view them as real). The ops still go
through the c10d dispatcher, so ``vescale.debug.CollectiveCounter`` and profilers see them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, ReduceScatterOptions

__all__ = ["all_gather", "all_gather_pieces", "reduce_scatter", "reduce_scatter_dim", "all_reduce", "wait"]


def _options(kind, async_op: bool, **fields):
    opts = kind()
    opts.asyncOp = async_op
    for name, value in fields.items():
        setattr(opts, name, value)
    return opts


# (collective, async_op) -> options: passed by reference and copied by c10d, so shared safely.
_OPTIONS = {
    (kind, a): _options(cls, a, **fields)
    for kind, cls, fields in (
        ("all_gather", AllgatherOptions, {}),
        ("reduce_scatter", ReduceScatterOptions, {"reduceOp": dist.ReduceOp.SUM}),
        ("all_reduce", AllreduceOptions, {"reduceOp": dist.ReduceOp.SUM}),
    )
    for a in (False, True)
}


def all_gather(out: torch.Tensor, t: torch.Tensor, group, async_op: bool = False):
    """``out`` (``group.size() * t.numel()`` elements) gets every member's ``t`` in rank order;
    returns the work to wait for when ``async_op`` (else None)."""
    if t.is_complex():
        return dist.all_gather_single(out, t, group=group, async_op=async_op)
    return _settle(group.all_gather_single(out, t, _OPTIONS["all_gather", async_op]), async_op)


def reduce_scatter(out: torch.Tensor, t: torch.Tensor, group, async_op: bool = False):
    """``out`` gets the sum over members of this rank's 1/size part of ``t`` (summed)."""
    if t.is_complex():
        return dist.reduce_scatter_single(out, t, group=group, async_op=async_op)
    return _settle(group.reduce_scatter_single(out, t, _OPTIONS["reduce_scatter", async_op]), async_op)


def all_gather_pieces(pieces: list[torch.Tensor], t: torch.Tensor, group) -> None:
    """``pieces[i]`` gets member i's ``t`` (real tensors). The pieces may be strided views of one
    tensor (the chunks of a non-leading dim): the backend copies into them where they lie."""
    wait(group.allgather([pieces], [t], _OPTIONS["all_gather", False]))


def reduce_scatter_dim(t: torch.Tensor, d: int, group) -> torch.Tensor:
    """This rank's chunk along dim ``d`` (one of ``group.size()`` equal ones) of the sum over
    members of ``t``, as a new contiguous tensor.

    A non-leading dim goes through the backend's list form, which reads the chunks where they lie
    (strided views): no stacking copy. Not on gloo, nor for complex tensors: gloo's list form sums
    the members in another order than its single-buffer form (the one DTensor's redistribution
    calls), so from 4 ranks on the bits differ, and it is slower on CPU than stacking the chunks
    along dim 0 and calling the single-buffer form (``tests/static/test_boundary.py``)."""
    n = group.size()
    if d != 0 and not t.is_complex() and dist.get_backend(group) != "gloo":
        pieces = list(t.chunk(n, d))
        out = torch.empty_like(pieces[0], memory_format=torch.contiguous_format)
        wait(group.reduce_scatter([out], [pieces], _OPTIONS["reduce_scatter", False]))
        return out
    stacked = torch.cat(t.chunk(n, d), dim=0) if d != 0 else t.contiguous()
    out = stacked.new_empty((stacked.shape[0] // n, *stacked.shape[1:]))
    reduce_scatter(out, stacked, group)
    return out


def all_reduce(t: torch.Tensor, group, async_op: bool = False):
    """``t`` summed over the members, in place."""
    if t.is_complex():
        return dist.all_reduce(t, group=group, async_op=async_op)
    return _settle(group.allreduce([t], _OPTIONS["all_reduce", async_op]), async_op)


def _settle(work, async_op: bool):
    if async_op:
        return work
    wait(work)
    return None


def wait(work) -> None:
    """Wait for ``work`` (backends that synchronise in C++ return None)."""
    if work is not None:
        work.wait()
