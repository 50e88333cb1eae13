"""How many bytes this rank holds for training state between steps.

Counts the local shards of parameters, their gradients and the optimiser's state tensors — the
memory that ZeRO-3 divides by the DP size. Activations and transient gathers are not counted: they
do not live between steps.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["bytes_at_rest"]


def _local_nbytes(t: torch.Tensor) -> int:
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def bytes_at_rest(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """{"params", "grads", "optimizer", "total"} bytes held by this rank."""
    params = list(model.parameters())
    out = {
        "params": sum(_local_nbytes(p) for p in params),
        "grads": sum(_local_nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": 0,
    }
    if optimizer is not None:
        out["optimizer"] = sum(
            _local_nbytes(v) for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
        )
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out
