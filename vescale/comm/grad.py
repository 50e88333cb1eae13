"""Gradient reduction: bring each parameter's gradient to the parameter's own placements.

Under data or sequence parallelism a weight gradient comes out of backward as ``Partial`` (each rank
holds a partial sum). Before it is accumulated into ``param.grad`` it is reduced to the parameter's
placements (all-reduce to Replicate, or reduce-scatter to Shard), so optimisers, gradient clipping and
gradient accumulation only ever see gradients laid out like their parameters.

This is the single seam where gradient communication happens; ZeRO-3 gradients arrive already
reduce-scattered (by the backward of the RUN-phase gather) and pass through unchanged.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["attach_grad_reduction"]


def _reduce_to_param_layout(param: DTensor):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            return grad.redistribute(param.device_mesh, param.placements)
        return grad

    return hook


def attach_grad_reduction(params) -> list:
    """Register the reduction on every DTensor parameter (before gradient accumulation). Returns the
    hook handles so that callers can remove them."""
    return [p.register_hook(_reduce_to_param_layout(p)) for p in params if isinstance(p, DTensor) and p.requires_grad]
