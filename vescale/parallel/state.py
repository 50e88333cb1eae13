"""The state_dict of a parallelized model, in layouts that torch.distributed.checkpoint can save.

DCP describes a rank's piece of a DTensor as one block (an offset and a size per dim). An
``InterleavedShard`` piece is ``interleave`` blocks, so DCP rejects it ("overlapping chunks"). The
model's ``state_dict()`` therefore gives interleaved tensors as the same global tensor laid out with
``Shard`` on that dim (one all-gather and a local slice per tensor, transiently the tensor's global
size); ``load_state_dict`` copies such a value back into the interleaved parameter, which
redistributes it. The checkpoint holds global tensors, so it loads into any mesh and plan, or into
the single-device model.

    sd = model.state_dict(); dcp.save(sd, checkpoint_id=path)
    sd = model.state_dict(); dcp.load(sd, checkpoint_id=path); model.load_state_dict(sd)
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from ..placement import blockwise, is_interleaved

__all__ = ["checkpointable", "attach_state_dict_hooks"]


def _needs_relayout(value) -> bool:
    """An interleaved DTensor whose shards are not single blocks. A ZeRO-3 shard nested in its TP
    shard (``InterleavedShard(d, TP)`` on DP, ``vescale.placement.nested``) is one block per rank,
    which DCP describes as it is: no relayout, no communication."""
    if not isinstance(value, DTensor) or not any(is_interleaved(p) for p in value.placements):
        return False
    return not blockwise(tuple(value.shape), tuple(value.device_mesh.shape), tuple(value.placements))


def checkpointable(value: Any) -> Any:
    """``value`` with every interleaved mesh dim laid out as ``Shard`` on the same tensor dim, where
    its shards are not blocks DCP can describe."""
    if not _needs_relayout(value):
        return value
    placements = [Shard(p.dim) if is_interleaved(p) else p for p in value.placements]
    return value.detach().redistribute(value.device_mesh, placements)


def _state_dict_hook(module, state_dict, prefix, local_metadata):
    for key, value in list(state_dict.items()):
        if key.startswith(prefix):
            state_dict[key] = checkpointable(value)
    return state_dict


def attach_state_dict_hooks(model: nn.Module) -> list:
    """Register the hook on ``model`` if any of its parameters or buffers is interleaved."""
    tensors = [*model.parameters(), *model.buffers()]
    if not any(_needs_relayout(t) for t in tensors):
        return []
    return [model._register_state_dict_hook(_state_dict_hook)]
