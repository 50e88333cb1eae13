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

One placement type, two meanings. ``_StridedShard(d, k)`` on a mesh dim alone on tensor dim ``d``
is ``k`` sections each split over that mesh dim (a fused q|k|v, or what DTensor's ``split`` /
``cat`` / ``view`` rules make of a sharded dim); first of several mesh dims on ``d`` it is a *shard
order* (the later mesh dims split ``d`` first, this one splits their pieces: the nested ZeRO layout).
A move between two layouts where a split changes meaning is where PyTorch 2.13's redistribution
planner goes wrong (it decodes ``_StridedShard`` as a shard order where it can and falls back to
a planner that ignores shard orders where it cannot; ``(Partial, _StridedShard(0, 3))`` ->
``(InterleavedShard(0, 2), Shard(0))``, a fused bias's gradient into its nested ZeRO shard, comes
out permuted). ``splits`` says what every mesh dim's split means, so that ``vescale.comm.moves`` can
take such moves one split at a time, each of them one DTensor gets right.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch.distributed.tensor import Placement, Shard
from vescale._torch import _is_shard_like

from .blocks import is_blockwise
from .interleaved import InterleavedShard

__all__ = ["nest_zero_shards", "blockwise", "shard_indices", "splits"]


def _plain_shard(p, dim: int) -> bool:
    return type(p) is Shard and p.dim == dim


def nest_zero_shards(init: tuple, run: tuple, shape: Sequence[int], mesh_shape: Sequence[int]) -> tuple:
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


def shard_indices(
    size: int, dim: int, mesh_shape: Sequence[int], coord: Sequence[int], placements: Sequence[Placement]
) -> torch.Tensor:
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


def splits(placements: tuple, mesh_shape: tuple) -> tuple | None:
    """What each mesh dim's placement means in this layout: ``placements[i]`` itself where it is not
    a shard; for a shard of tensor dim ``d``, ``(d, sections, before)``: ``sections`` is the number
    of equal sections each split on its own (1: a block split), ``before`` the mesh dims whose
    splits of ``d`` apply first, in order. A mesh dim means the same in two layouts exactly where
    these entries are equal (a nested ZeRO shard's TP split does; a TP split under a ZeRO split
    that was not there does not). None for a ``_StridedShard`` that is neither alone on its tensor
    dim nor the head of a nested ZeRO layout (``nest_zero_shards``'), which this does not read."""
    by_dim: dict[int, list[int]] = {}
    for i, p in enumerate(placements):
        if _is_shard_like(p):
            by_dim.setdefault(p.dim, []).append(i)
    out: list = list(placements)
    for d, mesh_dims in by_dim.items():
        strided = [i for i in mesh_dims if type(placements[i]) is not Shard]
        if not strided:
            order, sections = mesh_dims, {}  # plain shards split left to right
        elif len(mesh_dims) == 1:
            order, sections = mesh_dims, {mesh_dims[0]: placements[mesh_dims[0]]._split_factor_int()}
        else:
            head, inner = mesh_dims[0], mesh_dims[1:]
            if strided != [head] or placements[head]._split_factor_int() != math.prod(mesh_shape[j] for j in inner):
                return None
            order, sections = [*inner, head], {}  # nested: the inner (later) mesh dims split first
        for k, i in enumerate(order):
            out[i] = (d, sections.get(i, 1), tuple(order[:k]))
    return tuple(out)
