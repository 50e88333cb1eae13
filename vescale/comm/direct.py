"""Collectives called on the process group itself, with options made once.

``torch.distributed``'s functions wrap each call in torch-function dispatch, argument checks and
logging and coalescing decorators that cost more CPU than the collective itself on the small
buffers of a ZeRO-3 unit or a gradient bucket, and vescale.comm issues several per step. None of it
applies here: contiguous real tensors, a process group of a mesh this rank belongs to, outside any
coalescing block. Complex tensors take the wrappers (they view them as real). The ops still go
through the c10d dispatcher, so ``vescale.debug.CollectiveCounter`` and profilers see them.

On gloo (CPU training), all-gathers and the reduce-scatters of two-member groups go over gloo's
all-to-all instead (``_over_all_to_all``); on two-member groups an all-to-all of uneven parts
(``_exchange``): each member sends the other only what it needs and receives only the other's part,
nothing to or from itself. gloo's all-gather is a ring and its reduce-scatter is a
whole all-reduce followed by taking one chunk; an all-to-all moves only the bytes each member needs,
in one exchange, and costs 0.3-0.7x of either on 2-4 CPU processes (``benchmarks/bench_comm.py
--part 4``). A pair's exchange also skips copies: the all-gather's doubled send buffer, gloo's copy
of this rank's own part, the stacking of a reduce-scatter along another dim
(``pairs_exchange = False`` keeps the even all-to-all). gloo's point-to-point ``send`` / ``recv``
would do the same exchange but cost a static DP=2 x TP=2 step 30-45% more CPU on 4 CPU processes
(interleaved A/B). The results are gloo's own bits: an all-gather does no arithmetic, and a
two-member sum is ``a + b`` in either order. From three members on, gloo's all-reduce sums in ring
segments that do not line up with the chunks, so those reduce-scatters stay gloo's own (DTensor's
redistributions call it, and static steps must sum as they do).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist
from vescale._torch import AllgatherOptions, AllreduceOptions, AllToAllOptions, ReduceScatterOptions

__all__ = ["all_gather", "all_gather_dim", "reduce_scatter", "reduce_scatter_dim", "all_reduce", "wait", "meant"]


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
_OPTIONS["all_to_all", False] = _options(AllToAllOptions, False)
_OPTIONS["all_to_all", True] = _options(AllToAllOptions, True)

# process group -> whether its gathers and two-member reduce-scatters go over all-to-all (gloo)
_ALL_TO_ALL: dict = {}
# Two-member gloo groups exchange only the other member's part (else the even all-to-all); both
# ranks must agree.
pairs_exchange = True
# The kind of collective an all-to-all in flight stands for (read by vescale.debug.CollectiveCounter).
_MEANT = threading.local()


def _over_all_to_all(group) -> bool:
    known = _ALL_TO_ALL.get(group)
    if known is None:
        known = _ALL_TO_ALL[group] = dist.get_backend(group) == "gloo" and group.size() > 1
    return known


def meant() -> str | None:
    """While vescale issues an all-to-all in place of another collective: that one's kind."""
    return getattr(_MEANT, "kind", None)


def meant_nbytes() -> int:
    """While ``meant()`` names a collective: the bytes of its largest buffer (what
    ``vescale.debug.CollectiveCounter`` records), which a pair's exchange does not show."""
    return getattr(_MEANT, "nbytes", 0)


def _pair(group) -> int | None:
    """The other member's group rank, where ``group`` is a pair that exchanges parts; else None."""
    if not pairs_exchange or group.size() != 2 or not _over_all_to_all(group):
        return None
    return 1 - group.rank()


class _Then:
    """A collective in flight and the local step that completes it once its data has arrived."""

    def __init__(self, work, then):
        self.work, self.then = work, then

    def wait(self) -> bool:
        if self.work is not None:
            work, self.work = self.work, None
            wait(work)
            self.then()
        return True


def _exchange(sent: torch.Tensor, received: torch.Tensor, peer: int, group, kind: str, nbytes: int, async_op: bool):
    """Send ``sent`` to the other member of a pair and receive its tensor into ``received`` (both
    contiguous, of one size): an all-to-all with uneven parts, nothing to or from this rank itself,
    so gloo neither sends nor copies a part this rank already has."""
    n = sent.numel()
    splits = [0, n] if peer == 1 else [n, 0]
    _MEANT.kind, _MEANT.nbytes = kind, nbytes
    try:
        return group.alltoall_base(received.view(-1), sent.view(-1), splits, splits, _OPTIONS["all_to_all", async_op])
    finally:
        _MEANT.kind, _MEANT.nbytes = None, 0


def _all_to_all(out: torch.Tensor, t: torch.Tensor, group, kind: str, async_op: bool):
    """Member i's i-th 1/size of ``t`` lands in this rank's i-th 1/size of ``out`` (flat views)."""
    _MEANT.kind = kind
    try:
        return group.alltoall_base(out.view(-1), t.view(-1), [], [], _OPTIONS["all_to_all", async_op])
    finally:
        _MEANT.kind = None


def all_gather(out: torch.Tensor, t: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False) -> Any:
    """``out`` (``group.size() * t.numel()`` elements) gets every member's ``t`` in rank order;
    returns the work to wait for when ``async_op`` (else None)."""
    if t.is_complex():
        return dist.all_gather_single(out, t, group=group, async_op=async_op)
    peer = _pair(group)
    if peer is not None:  # the other member's ``t`` straight into its half; ours copied into ours
        halves = out.view(2, -1)
        work = _exchange(t.reshape(-1), halves[peer], peer, group, "all_gather", out.numel() * out.element_size(), async_op)
        halves[1 - peer].copy_(t.reshape(-1))
        return _settle(work, async_op)
    if _over_all_to_all(group):  # every member is sent the whole of ``t``
        sent = t.reshape(1, -1).expand(group.size(), -1).contiguous()
        return _settle(_all_to_all(out, sent, group, "all_gather", async_op), async_op)
    return _settle(group.all_gather_single(out, t, _OPTIONS["all_gather", async_op]), async_op)


def reduce_scatter(out: torch.Tensor, t: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False) -> Any:
    """``out`` gets the sum over members of this rank's 1/size part of ``t`` (summed)."""
    if t.is_complex():
        return dist.reduce_scatter_single(out, t, group=group, async_op=async_op)
    peer = _pair(group)
    if peer is not None:  # send the other member its half, receive ours from it, then a + b
        halves = t.reshape(2, -1)
        theirs = torch.empty_like(halves[0])
        work = _exchange(halves[peer], theirs, peer, group, "reduce_scatter", t.numel() * t.element_size(), True)
        done = _Then(work, lambda: torch.add(halves[1 - peer], theirs, out=out.view(-1)))
        return _settle(done, async_op)
    if group.size() == 2 and _over_all_to_all(group):  # the two summands of this rank's part, then a + b
        both = torch.empty_like(t, memory_format=torch.contiguous_format).view(2, -1)
        work = _all_to_all(both, t, group, "reduce_scatter", async_op=True)
        done = _Then(work, lambda: torch.add(both[0], both[1], out=out.view(-1)))
        return _settle(done, async_op)
    return _settle(group.reduce_scatter_single(out, t, _OPTIONS["reduce_scatter", async_op]), async_op)


def all_gather_dim(t: torch.Tensor, d: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Every member's ``t`` joined along dim ``d`` in rank order, as a new contiguous tensor.

    A non-leading dim goes through the backend's list form, which writes each member's part where
    it lies in the result (strided views): no copy of our own. Not on gloo, whose all-to-all is
    cheaper than that ring even with the joining copy, nor for complex tensors."""
    t = t.contiguous()
    n = group.size()
    peer = _pair(group) if d != 0 and not t.is_complex() else None
    if peer is not None:  # the other member's part received whole, then joined once
        theirs = torch.empty_like(t)
        wait(_exchange(t, theirs, peer, group, "all_gather", 2 * t.numel() * t.element_size(), False))
        return torch.cat([t, theirs] if peer == 1 else [theirs, t], dim=d)
    if d != 0 and not t.is_complex() and not _over_all_to_all(group):
        shape = list(t.shape)
        shape[d] *= n
        out = t.new_empty(shape)
        wait(group.allgather([list(out.chunk(n, d))], [t], _OPTIONS["all_gather", False]))
        return out
    out = t.new_empty((n * t.shape[0], *t.shape[1:]))
    all_gather(out, t, group)
    return out if d == 0 else torch.cat(out.chunk(n, 0), dim=d)


def reduce_scatter_dim(t: torch.Tensor, d: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's chunk along dim ``d`` (one of ``group.size()`` equal ones) of the sum over
    members of ``t``, as a new contiguous tensor.

    A non-leading dim goes through the backend's list form, which reads the chunks where they lie
    (strided views): no stacking copy. Not on gloo, nor for complex tensors: gloo's list form sums
    the members in another order than its single-buffer form (the one DTensor's redistribution
    calls), so from 4 ranks on the bits differ, and it is slower on CPU than stacking the chunks
    along dim 0 and calling the single-buffer form (``tests/static/test_boundary.py``). A gloo pair
    stacks nothing: it sends the other member's chunk and adds the one received to its own, read in
    place (see the module's docstring)."""
    n = group.size()
    peer = _pair(group) if d != 0 and not t.is_complex() else None
    if peer is not None:  # only the other member's chunk made contiguous (to send); a + b read in place
        pieces = t.chunk(2, d)
        theirs = torch.empty_like(pieces[peer], memory_format=torch.contiguous_format)
        wait(_exchange(pieces[peer].contiguous(), theirs, peer, group, "reduce_scatter", t.numel() * t.element_size(), False))
        return torch.add(pieces[1 - peer], theirs, out=torch.empty_like(theirs))
    if d != 0 and not t.is_complex() and dist.get_backend(group) != "gloo":
        pieces = list(t.chunk(n, d))
        out = torch.empty_like(pieces[0], memory_format=torch.contiguous_format)
        wait(group.reduce_scatter([out], [pieces], _OPTIONS["reduce_scatter", False]))
        return out
    stacked = torch.cat(t.chunk(n, d), dim=0) if d != 0 else t.contiguous()
    out = stacked.new_empty((stacked.shape[0] // n, *stacked.shape[1:]))
    reduce_scatter(out, stacked, group)
    return out


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False) -> Any:
    """``t`` summed over the members, in place."""
    if t.is_complex():
        return dist.all_reduce(t, group=group, async_op=async_op)
    return _settle(group.allreduce([t], _OPTIONS["all_reduce", async_op]), async_op)


def _settle(work, async_op: bool):
    if async_op:
        return work
    wait(work)
    return None


def wait(work: Any) -> None:
    """Wait for ``work`` (backends that synchronise in C++ return None)."""
    if work is not None:
        work.wait()
