"""Allocate the shards of a meta-device model and replay its own init code on them.

Each meta parameter becomes a DTensor in its INIT placements whose local tensor is allocated at the
shard's size (never the global size). The model's init code then runs on those DTensors: its random
ops go to vescale's DTensor RNG, which draws every element by its *global* index from the
generator's single-device stream, so each shard holds exactly the single-device values, and
non-random ops (``fill_``, ``zero_``, ``copy_`` of a computed table) act locally. Which init code:

1. ``model.init_weights()`` when the model defines it (the zoo's LLaMA; every HF ``PreTrainedModel``,
   whose ``init_weights`` applies ``_init_weights`` to every module and ties weights). A model that
   can be rebuilt from its config gets the values of a *normal build*, the constructor's own draws
   included: ``build.py`` replays each parameter's draw at the generator offset a normal build
   draws it at;
2. otherwise ``reset_parameters()`` of every module that has one, in ``named_modules()`` order (the
   order their constructors ran it).

Parameters and buffers are filled with NaN (integers: a sentinel is impossible, so such meta
buffers are refused) before the replay; any still holding NaN afterwards were not initialised by
that code, and ``materialize`` raises an error naming them, on every rank, instead of training on
garbage. A model built on the meta device used to be accepted and fail in forward.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate

from .. import random as vescale_random
from ..mesh import adopt_mesh
from ..placement.blocks import local_shape_and_offset
from .build import DrawAtRecordedOffsets, rebuildable, record_build

__all__ = ["DeferredInitError", "has_meta", "init_entry_point", "materialize", "empty_shard"]


class DeferredInitError(RuntimeError):
    """A meta-device model whose values vescale cannot produce."""


def has_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def init_entry_point(model: nn.Module) -> str | None:
    """The init code deferred initialisation replays: "init_weights", "reset_parameters" or None."""
    if callable(getattr(model, "init_weights", None)):
        return "init_weights"
    if any(callable(getattr(m, "reset_parameters", None)) for m in model.modules()):
        return "reset_parameters"
    return None


def empty_shard(
    shape: Sequence[int], dtype: torch.dtype, mesh: DeviceMesh, placements: Sequence[Placement], fill: float = float("nan")
) -> DTensor:
    """A DTensor of global ``shape`` whose local tensor is this rank's shard only, filled with ``fill``."""
    local_shape, _ = local_shape_and_offset(shape, mesh, placements, skip_offset=True)
    local = torch.full(local_shape, fill, dtype=dtype, device=mesh.device_type)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


def _materialize_tensors(model: nn.Module, mesh: DeviceMesh, placements: dict) -> None:
    """Meta parameters -> shard-sized DTensor parameters (NaN), meta buffers -> plain tensors (NaN)."""
    done: dict[int, nn.Parameter] = {}
    for mpath, mod in model.named_modules(remove_duplicate=False):
        for name, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in done:  # tied parameters stay one tensor
                target = placements.get((mpath, name), (Replicate(),) * mesh.ndim)
                shard = empty_shard(tuple(p.shape), p.dtype, mesh, target)
                done[id(p)] = nn.Parameter(shard, requires_grad=p.requires_grad)
            mod._parameters[name] = done[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is None or not b.is_meta:
                continue
            if not b.dtype.is_floating_point:
                where = f"{mpath}.{name}" if mpath else name
                raise DeferredInitError(
                    f"deferred init: buffer {where!r} ({b.dtype}) is on the meta device and vescale cannot tell whether "
                    "the model's init code fills it; build the model on a real device, or register the buffer "
                    "after parallelize"
                )
            if (mpath, name) in placements:
                mod._buffers[name] = empty_shard(tuple(b.shape), b.dtype, mesh, placements[(mpath, name)])
            else:
                mod._buffers[name] = torch.full(b.shape, float("nan"), dtype=b.dtype, device=mesh.device_type)


def _uninitialised(model: nn.Module) -> list[str]:
    named = [*model.named_parameters(), *model.named_buffers()]
    bad = []
    for n, t in named:
        local = t._local_tensor if isinstance(t, DTensor) else t
        if local.dtype.is_floating_point and bool(torch.isnan(local).any()):
            bad.append(n)
    return bad


def materialize(model: nn.Module, mesh: DeviceMesh, placements: dict) -> str:
    """Allocate the model's meta tensors as shards (``placements``: (module path, tensor name) ->
    INIT placements) and initialise them with the model's own init code; returns which one ran."""
    entry = init_entry_point(model)
    if entry is None:
        raise DeferredInitError(
            f"deferred init: {type(model).__name__} was built on the meta device but has no init code to replay "
            "(no init_weights() and no module with reset_parameters()); build it on a real device"
        )
    # A model that can be rebuilt from its config gets the values of a normal build, constructor
    # draws included (vescale/init/build.py); others the values of their init code replayed.
    build = record_build(model) if entry == "init_weights" and rebuildable(model) else None
    draws, build_end = build if build is not None else (None, None)
    _materialize_tensors(model, mesh, placements)
    adopt_mesh(mesh)
    vescale_random.install()
    at_offsets = DrawAtRecordedOffsets(model, draws) if draws is not None else contextlib.nullcontext()
    with torch.no_grad(), vescale_random.consistent(), at_offsets:
        if entry == "init_weights":
            model.init_weights()
        else:
            for m in model.modules():
                if callable(getattr(m, "reset_parameters", None)):
                    m.reset_parameters()
    if draws is not None:
        at_offsets.finish(build_end)
    bad = _uninitialised(model)
    # Agree across ranks: a rank whose shard of a tensor is empty cannot see it is uninitialised.
    flag = torch.tensor([len(bad)], device=mesh.device_type)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        raise DeferredInitError(
            f"deferred init: the model's {entry}() left parameters/buffers uninitialised"
            f"{' (e.g. ' + ', '.join(bad[:5]) + ')' if bad else ' on another rank'}; give the model init code that "
            "sets every parameter (init_weights() or reset_parameters()), or build it on a real device"
        )
    return entry
