"""Putting a tensor into planned placements, whatever it is now.

A plain ``torch.Tensor`` met by vescale is taken for what it is in the single-device program: the
whole (global) tensor, identical on every rank. It becomes a Replicate DTensor and is then
redistributed, so ``Replicate -> Shard`` costs a local slice and no communication. A DTensor is
redistributed only along the mesh dimensions the plan names (``None`` = leave as is).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from torch.distributed.tensor.placement_types import _is_shard_like

from ..placement import InterleavedShard, interleave_of, is_interleaved
from ..plan.ir import PlanError

__all__ = ["as_dtensor", "place"]


def as_dtensor(t: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """A plain tensor, taken as the global tensor held identically on every rank, as a DTensor."""
    if isinstance(t, DTensor):
        return t
    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)


def place(t, mesh: DeviceMesh, targets: Sequence[Optional[Placement]], what: str) -> DTensor:
    """Redistribute ``t`` to ``targets`` (one entry per mesh dim; None keeps the current one)."""
    if not isinstance(t, torch.Tensor):
        raise PlanError(f"{what}: the plan places a tensor here, but the value is a {type(t).__name__}")
    if isinstance(t, DTensor) and t.device_mesh != mesh:
        raise PlanError(f"{what}: tensor lives on mesh {t.device_mesh}, the plan's mesh is {mesh}")
    d = as_dtensor(t, mesh)
    want = tuple(cur if tgt is None else tgt for cur, tgt in zip(d.placements, targets))
    for p in want:
        if _is_shard_like(p) and not -d.ndim <= p.dim < d.ndim:
            raise PlanError(
                f"{what}: {f'Shard({p.dim})' if isinstance(p, Shard) else repr(p)} does not fit a tensor of shape {tuple(d.shape)}; "
                f"use a dim in [0, {d.ndim})"
            )
        if is_interleaved(p) and d.shape[p.dim] % interleave_of(p):
            raise PlanError(
                f"{what}: {p!r} needs dim {p.dim} of a tensor of shape {tuple(d.shape)} to split into "
                f"{interleave_of(p)} equal sections"
            )
    want = tuple(InterleavedShard(p.dim % d.ndim, interleave_of(p)) if is_interleaved(p) else p for p in want)
    if want == tuple(d.placements):
        return d
    return d.redistribute(mesh, want)
