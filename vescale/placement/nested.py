"""ZeRO shards nested inside tensor-parallel shards: FSDP2's at-rest layout, and a test for layouts
whose every shard is one contiguous block.

A plan that shards a weight's dim 0 on TP (``Shard(0)``, column-wise) and, for ZeRO-3, on DP at rest
(``Shard(0)`` in phase INIT, ``Replicate()`` in phase RUN) asks for ``(Shard(0), Shard(0))`` at rest
on a ``(DP, TP)`` mesh. DTensor applies placements left to right, so that layout splits dim 0 by DP
first and by TP within: rank ``(dp, tp)`` holds block ``dp * TP + tp``. Its RUN layout
``(Replicate(), Shard(0))`` (block ``tp`` of TP) is then no union of the blocks of one DP group, and
every gather has to move the whole weight over all DP x TP ranks and slice.

``nest_zero_shards`` lays such a weight out the other way round, as FSDP2 does for FSDP x TP: the TP
split first, then each TP shard split by DP, so that rank ``(dp, tp)`` holds block ``tp * DP + dp``,
a piece of its own TP shard. In DTensor terms the DP placement becomes
``InterleavedShard(0, interleave=TP)`` (PyTorch's ``_StridedShard(0, split_factor=TP)``, the
placement FSDP2 uses): the dim is read as TP sections (the TP shards) and each is sharded over DP.
Gathering over DP alone then gives ``(Replicate(), Shard(0))``: 1/TP of the bytes, a DP-sized group.

Every rank's shard is still one contiguous block of the global tensor (``blockwise``), so DCP,
``compute_local_shape_and_global_offset``, vescale.random and ``vescale.comm``'s block plans describe
it exactly. PyTorch distributes ``_StridedShard`` only where the dim divides evenly, so a dim that
does not divide by DP x TP keeps the plain ``(Shard, Shard)`` layout.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Placement, Shard
from torch.distributed.tensor.placement_types import _is_shard_like

from .blocks import is_blockwise
from .interleaved import InterleavedShard

__all__ = ["nest_zero_shards", "blockwise", "shard_indices"]


def _plain_shard(p, dim: int) -> bool:
    return type(p) is Shard and p.dim == dim


def nest_zero_shards(init: tuple, run: tuple, shape, mesh_shape) -> tuple:
    """``init`` (at-rest placements, one per mesh dim) with each ZeRO shard nested inside the RUN
    shards of later mesh dims on the same tensor dim (see the module docstring); unchanged where
    that does not apply (other placements, several ZeRO dims on one tensor dim, uneven sizes)."""
    out = list(init)
    for i, p in enumerate(init):
        if type(p) is not Shard or run[i] == p:
            continue  # not a ZeRO (INIT-only) shard
        k = p.dim
        others = [j for j, q in enumerate(init) if j != i and _is_shard_like(q) and q.dim == k]
        kept = [j for j in others if j > i and _plain_shard(init[j], k) and run[j] == init[j]]
        if not kept or kept != others:
            continue  # nothing to nest inside, or a layout this rule does not describe
        inner = math.prod(mesh_shape[j] for j in kept)
        if inner == 1 or shape[k] % (inner * mesh_shape[i]):
            continue  # the same layout anyway / PyTorch cannot distribute it unevenly
        out[i] = InterleavedShard(k, inner)
    return tuple(out)


def shard_indices(size: int, dim: int, mesh_shape, coord, placements) -> torch.Tensor:
    """The global indices along tensor dim ``dim`` (of length ``size``) that the shard at mesh
    coordinate ``coord`` holds, in local order (each placement's own split, left to right, as
    ``distribute_tensor`` applies them)."""
    index = torch.arange(size).view([1] * dim + [size])  # the placements split tensor dim ``dim``
    for mesh_dim, p in enumerate(placements):
        if _is_shard_like(p) and p.dim == dim:
            index = p._select_split_tensor(
                index, mesh_shape[mesh_dim], coord[mesh_dim], with_padding=False, contiguous=False, clone=False
            )
    return index.reshape(-1)


def blockwise(shape: tuple, mesh_shape: tuple, placements: tuple[Placement, ...]) -> bool:
    """Whether every rank's shard is one contiguous block of the global tensor (consecutive global
    indices along every dim). True for Shard/Replicate/Partial layouts and for ``nest_zero_shards``'
    layouts; False for an ``InterleavedShard`` of fused sections. Decided by arithmetic at a few
    representative coordinates (``vescale.placement.blocks``), not rank by rank."""
    if not any(_is_shard_like(p) and type(p) is not Shard for p in placements):
        return True  # plain Shard splits are always blocks
    return is_blockwise(tuple(shape), tuple(mesh_shape), tuple(placements))
