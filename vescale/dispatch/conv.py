"""Convolutions on DTensors: plain tensors meet DTensors as Replicate here too.

PyTorch routes ``aten.convolution`` and ``aten.convolution_backward`` on DTensors to its own
handlers (``torch/distributed/tensor/_tp_conv.py``, spatial tensor parallelism with halo
exchange). Those handlers assert that the input and grad-output are DTensors, so an unplanned
(plain) image batch entering a Conv2d whose weight is a DTensor — every parameter is one after
``parallelize`` — failed in backward with a bare ``AssertionError``, against vescale's rule that a
plain tensor is the global tensor and meets DTensors as Replicate.

The handlers here turn plain tensor arguments into Replicate DTensors on the mesh of the DTensor
arguments (what implicit replication does for every other op) and hand the call to PyTorch's
handler. PyTorch's convolution rules derive the output layout from the input alone and ignore a
sharded weight (a ``Shard(0)`` weight would give half the channels labelled Replicate), so a
sharded convolution weight is refused with the plan statement that fixes it.
"""

from __future__ import annotations

import re

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._tp_conv import convolution_backward_handler, convolution_handler

from .errors import MissingShardingRule, running_module

__all__ = ["install_conv_handlers"]

aten = torch.ops.aten


def _as_dtensors(args, weight_index: int):
    mesh = next(a.device_mesh for a in args if isinstance(a, DTensor))
    weight = args[weight_index]
    if isinstance(weight, DTensor) and any(not p.is_replicate() for p in weight.placements):
        path, _ = running_module()
        name = (re.escape(path) + r"\.weight") if path else r"<conv path>\.weight"
        raise MissingShardingRule(
            f"vescale: convolution in module {path!r} has a sharded weight {list(weight.placements)}; DTensor's "
            "convolution supports batch- or width-sharded inputs with a replicated weight only (it would "
            f"mislabel the output). Fix: plan.shard(r\"{name}\", Replicate(), mesh=<its mesh dim>)"
        )

    def lift(a):
        if isinstance(a, torch.Tensor) and not isinstance(a, DTensor):
            return DTensor.from_local(a, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return a

    return tuple(lift(a) for a in args)


def _convolution(op, args, kwargs):
    return convolution_handler(op, _as_dtensors(args, 1), kwargs)


def _convolution_backward(op, args, kwargs):
    return convolution_backward_handler(op, _as_dtensors(args, 2), kwargs)


_HANDLERS = {aten.convolution.default: _convolution, aten.convolution_backward.default: _convolution_backward}


def install_conv_handlers() -> None:
    """Put the handlers in DTensor's per-op handler table (idempotent)."""
    DTensor._op_dispatcher._custom_op_handlers.update(_HANDLERS)
