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

PyTorch's handlers are right only for an input split along the batch on mesh dim 0: their backward
rule labels the weight's gradient ``Partial`` on mesh dim 0 whatever dims split the input (a batch
split on another mesh dim left each rank with its own partial gradient), their halo exchange for a
width-split input uses the global rank and world size and 4-D indexing (a ``Conv1d`` on a
sequence-parallel input gave a wrong output), and a batch split on two mesh dims raised DTensor's
"hybrid sharding" ``ValueError`` (found by the differential fuzzer, ``tests/fuzz``). So the
convolution runs here on local tensors in one layout: the batch stays split on whatever mesh dims
split it, every other split (channels, width) and a ``Partial`` input are gathered first (the
convolution mixes neighbouring positions and sums over channels); the output keeps that layout, the
input's gradient comes out in it, and the weight's and bias's gradients are ``Partial`` on exactly
the mesh dims that split the batch (each rank's sum over its samples).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from vescale._torch import DTensorSpec, TensorMeta, PATCHES

from .errors import MissingShardingRule, running_module
from .attention import _stride_like
from ..scope import for_vescale_meshes

__all__ = ["install_conv_handlers"]

aten = torch.ops.aten


def _as_dtensors(args, weight_index: int):
    mesh = next(a.device_mesh for a in args if isinstance(a, DTensor))
    weight = args[weight_index]
    # A shard on a mesh dim of one rank holds the whole weight: as good as replicated.
    if isinstance(weight, DTensor) and any(not p.is_replicate() and n > 1 for p, n in zip(weight.placements, weight.device_mesh.shape)):
        path, _ = running_module()
        name = (re.escape(path) + r"\.weight") if path else r"<conv path>\.weight"
        raise MissingShardingRule(
            f"vescale: convolution in module {path!r} has a sharded weight {list(weight.placements)}; convolutions "
            "on DTensors take inputs in any layout (split along the batch, or gathered) with a replicated weight "
            f"only. Fix: plan.shard(r\"{name}\", Replicate(), mesh=<its mesh dim>)"
        )

    def lift(a: Any) -> Any:
        if isinstance(a, torch.Tensor) and not isinstance(a, DTensor):
            return DTensor.from_local(a, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return a

    return tuple(lift(a) for a in args)


def _batch_layout(x: DTensor) -> list:
    """``x``'s placements with only plain batch splits kept (what a local convolution can take)."""
    return [p if type(p) is Shard and p.dim == 0 else Replicate() for p in x.placements]


def _wrap(local: torch.Tensor, like: DTensor, placements, shape) -> DTensor:
    """``local`` as a DTensor on ``like``'s mesh; its global strides follow the local memory layout
    (a channels-last kernel result stays channels-last)."""
    spec = DTensorSpec(like.device_mesh, tuple(placements),
                       tensor_meta=TensorMeta(torch.Size(shape), _stride_like(local, shape), local.dtype))
    return DTensor._op_dispatcher.wrap(local, spec)


@for_vescale_meshes
def _convolution(op, args, kwargs):
    x, weight, bias, *rest = _as_dtensors(args, 1)
    layout = _batch_layout(x)
    x = x.redistribute(x.device_mesh, layout)
    local = op(x._local_tensor, weight._local_tensor, None if bias is None else bias._local_tensor, *rest, **kwargs)
    return _wrap(local, x, layout, (x.shape[0], *local.shape[1:]))


@for_vescale_meshes
def _convolution_backward(op, args, kwargs):
    grad_out, x, weight, *rest = _as_dtensors(args, 2)
    layout = _batch_layout(x)
    x, grad_out = x.redistribute(x.device_mesh, layout), grad_out.redistribute(x.device_mesh, layout)
    grad_x, grad_w, grad_b = op(grad_out._local_tensor, x._local_tensor, weight._local_tensor, *rest, **kwargs)
    summed = [Partial() if isinstance(p, Shard) else Replicate() for p in layout]  # each rank's samples
    return (
        None if grad_x is None else _wrap(grad_x, x, layout, x.shape),
        None if grad_w is None else _wrap(grad_w, x, summed, weight.shape),
        None if grad_b is None else _wrap(grad_b, x, summed, grad_b.shape),
    )


_HANDLERS = {aten.convolution.default: _convolution, aten.convolution_backward.default: _convolution_backward}


def install_conv_handlers() -> None:
    """Put the handlers in DTensor's per-op handler table (idempotent)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op, handler in _HANDLERS.items():
        PATCHES.set_item("dispatch.coverage.conv", handlers, op, handler, f"DTensor custom handler {op}")


