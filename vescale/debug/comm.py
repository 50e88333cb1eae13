"""Counting the collectives a piece of code issues, whoever issues them.

``CollectiveCounter`` is a dispatch mode that sees both DTensor's functional collectives
(``_c10d_functional.*``) and direct ``torch.distributed`` calls (``c10d.*``, the ops behind
``dist.all_reduce`` and friends, which ``vescale.comm`` uses), by kind. Unlike
``torch.distributed.tensor.debug.CommDebugMode`` it does not track modules, so it works with any
module hooks. Waits and barriers are not counted. Ops on DTensors are left to DTensor with the mode
still open (as PyTorch's ``CommDebugMode`` does), so the collectives of implicit redistributions inside
DTensor's dispatch are counted too.
"""

from __future__ import annotations

import collections

from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

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


class CollectiveCounter(TorchDispatchMode):
    """``with CollectiveCounter() as c: ...`` then ``c.counts`` ({kind: n}) and ``c.total``."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # Let DTensor run the op with this mode still open, so that the collectives of its
            # implicit redistributions (issued inside its dispatch, on plain tensors) are seen too;
            # handling the op here would run DTensor's dispatch with this mode popped.
            return NotImplemented
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            kind = _KINDS.get(func._opname)
            if kind is not None:
                self.counts[kind] += 1
        return func(*args, **(kwargs or {}))
