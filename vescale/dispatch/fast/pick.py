"""Replicate -> Shard inside DTensor's own redistribution: one narrow, not one chunk per rank.

DTensor takes a replicated tensor to a shard on the local tensor (``Shard._replicate_to_shard``)
by splitting it into one chunk per rank of the mesh dim and keeping one: ``torch.chunk`` makes
``n`` views and PyTorch's Python loop visits each, so the cost grows with the mesh dim (at DP = 1,024
about a thousand views per move, for one of them). Ops that move an input this way inside dispatch
(an embedding's backward, the EP experts' eager path) then cost more per rank the larger the world.

``install_shard_pick`` gives ``Shard`` a ``_replicate_to_shard`` that narrows straight to this rank's
chunk: torch.chunk's chunk size (the ceiling of size / n), the chunk at ``index`` or an empty one
past the end, cloned as PyTorch clones it, so the local tensor is the same bits and layout. Only
for ``Shard`` itself with an int index outside tracing; subclasses (``_StridedShard``, vescale's
``InterleavedShard``), symbolic indices and traced programs keep PyTorch's path.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard
from vescale._torch import PATCHES

__all__ = ["install_shard_pick", "uninstall_shard_pick", "pick_chunk"]

_ORIGINAL = Shard.__dict__["_replicate_to_shard"]


def pick_chunk(tensor: torch.Tensor, dim: int, chunks: int, index: int) -> torch.Tensor:
    """``torch.chunk(tensor, chunks, dim)[index]`` (an empty chunk where chunk makes fewer), cloned."""
    size = tensor.size(dim)
    step = -(-size // chunks)
    start = min(step * index, size)
    return tensor.narrow(dim, start, min(step, size - start)).clone()


def _replicate_to_shard(self, local_tensor, mesh, mesh_dim, shard_index):
    if (type(self) is not Shard or type(shard_index) is not int or local_tensor.dim() == 0
            or local_tensor.size(self.dim) == 0 or _tracing()):
        return _ORIGINAL(self, local_tensor, mesh, mesh_dim, shard_index)
    return pick_chunk(local_tensor, self.dim, mesh.size(mesh_dim=mesh_dim), shard_index)


def _tracing() -> bool:
    from vescale._torch import _are_we_tracing

    return _are_we_tracing()


def install_shard_pick() -> None:
    PATCHES.set_attr("dispatch.fast.pick", Shard, "_replicate_to_shard", _replicate_to_shard)


def uninstall_shard_pick() -> None:
    PATCHES.undo("dispatch.fast.pick")


