"""Op handlers that make DTensor answer like the single-device tensor it stands for.

``item()`` (aten._local_scalar_dense) on a DTensor returns the *local* value in PyTorch, which for a
Partial DTensor — a loss averaged over a batch-sharded output, say — is this rank's partial result,
different on every rank. Under vescale's contract a DTensor is its global tensor, so ``item()``,
``float()`` and ``tolist()`` of a one-element tensor return the global value.

Handlers go into DTensor's own per-op extension table when parallelize() runs, never at import.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["install_semantic_handlers"]

aten = torch.ops.aten


def _global_scalar(op, args, kwargs):
    (t,) = args
    if all(p.is_replicate() for p in t.placements):
        return op(t._local_tensor)
    # Partial or sharded: each rank holds a piece; the value is the global one.
    return op(t.full_tensor())


_HANDLERS = {aten._local_scalar_dense.default: _global_scalar}


def install_semantic_handlers() -> None:
    """Register the handlers (idempotent)."""
    DTensor._op_dispatcher._custom_op_handlers.update(_HANDLERS)
