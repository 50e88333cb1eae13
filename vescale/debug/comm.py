"""Counting the collectives a piece of code issues, whoever issues them.

``CollectiveCounter`` is a dispatch mode that sees both DTensor's functional collectives
(``_c10d_functional.*``) and direct ``torch.distributed`` calls (``c10d.*``, the ops behind
``dist.all_reduce`` and friends, which ``vescale.comm`` uses), by kind. Unlike
``torch.distributed.tensor.debug.CommDebugMode`` it does not track modules, so it works with any
module hooks. Waits and barriers are not counted. Ops on DTensors are left to DTensor with the mode
still open (as PyTorch's ``CommDebugMode`` does), so the collectives of implicit redistributions inside
DTensor's dispatch are counted too, unless another dispatch mode is open beneath this one (a Static
Eager recording step's watcher): then those modes see the op first and its implicit collectives are
not counted. An all-to-all that ``vescale.comm`` issues in place of an all-gather or reduce-scatter
(on gloo, see ``vescale.comm.direct``) counts as the collective it stands for, with that one's
bytes.
"""

from __future__ import annotations

import collections

import torch
from torch.distributed.tensor import DTensor
from vescale._torch import TorchDispatchMode, _get_current_dispatch_mode_stack, tree_leaves

from ..comm import direct

__all__ = ["CollectiveCounter"]

_KINDS = {
    "all_reduce": "all_reduce", "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather", "_allgather_base_": "all_gather", "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all", "alltoall_base_": "all_to_all", "alltoall_": "all_to_all",
    "broadcast_": "broadcast", "broadcast": "broadcast",
}


def _dtype(tree) -> torch.dtype | None:
    """The dtype of the first tensor in ``tree`` (the data a collective moves)."""
    return next((t.dtype for t in tree_leaves(tree) if isinstance(t, torch.Tensor)), None)


def _nbytes(tree) -> int:
    """Bytes of the largest tensor in ``tree`` (args or results of one collective): the gathered
    output of an all-gather, the input of a reduce-scatter, the buffer of an all-reduce."""
    return max((t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)), default=0)


class CollectiveCounter(TorchDispatchMode):
    """``with CollectiveCounter() as c: ...`` then ``c.counts`` ({kind: n}), ``c.total`` and
    ``c.nbytes`` ({kind: bytes}; per collective, its largest buffer: see ``_nbytes``) and
    ``c.dtypes`` ({(kind, dtype): n}: the dtype of the data each collective moves, e.g. to check a
    mixed-precision policy's gather and reduction dtypes)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.nbytes: collections.Counter = collections.Counter()
        self.dtypes: collections.Counter = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types) and not _get_current_dispatch_mode_stack():
            # Let DTensor run the op with this mode still open, so that the collectives of its
            # implicit redistributions (issued inside its dispatch, on plain tensors) are seen too;
            # handling the op here would run DTensor's dispatch with this mode popped. Only when
            # no other mode is open beneath: NotImplemented skips those modes for this op, and
            # one that must see every DTensor op (Static Eager's recording watcher) would miss it.
            return NotImplemented
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            kind = _KINDS.get(func._opname)
            meant = direct.meant() if kind == "all_to_all" else None
            if meant is not None:  # vescale.comm's gloo all-gathers and reduce-scatters are all-to-alls
                kind = meant
            if kind is not None:
                out = func(*args, **(kwargs or {}))
                self.counts[kind] += 1
                self.dtypes[(kind, _dtype((args, kwargs)))] += 1
                self.nbytes[kind] += max(_nbytes((args, kwargs)), _nbytes(out), direct.meant_nbytes() if meant else 0)
                return out
        return func(*args, **(kwargs or {}))
