"""A shorter ``unwrap_to_op_info`` for the common call: DTensor and scalar arguments, nothing nested.

PyTorch 2.13's C++ dispatcher calls ``OpDispatcher.unwrap_to_op_info`` (Python) on every miss of its
own sharding cache: every op of a first step, and every op at a new sequence length. That general
function looks up pytree needs, checks every argument for tensor lists, handles plain tensors
(implicit replication, scalar tensors) and keyword tensors; ~10 us an op inside a step, ~1.5 ms of
a new MoE step's ~10 ms extra (151 calls). Most calls have none of those: DTensors, sizes and
scalars, positionally. ``unwrap_to_op_info`` below builds the same ``OpInfo`` for those directly
and hands every other call to PyTorch's own function, so the answers are PyTorch's
(``tests/dispatch/test_unwrap.py`` compares them field by field).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from vescale._torch import OpInfo, OpSchema, PATCHES

__all__ = ["unwrap_to_op_info", "install_unwrap", "uninstall_unwrap"]


def _holds_tensor(values) -> bool:
    for value in values:
        if isinstance(value, torch.Tensor):
            return True
    return False


def unwrap_to_op_info(op_call: Any, args: tuple, kwargs: dict) -> OpInfo:
    """``OpDispatcher.unwrap_to_op_info``'s answer; built here when every argument is a DTensor
    (the exact type), a list of non-tensors (sizes, dims) or another non-tensor value, and no keyword
    argument is a tensor."""
    dispatcher = DTensor._op_dispatcher
    propagator = dispatcher.sharding_propagator
    schema_info = propagator.op_to_schema_info.get(op_call)
    if schema_info is None:
        schema_info = propagator.op_to_schema_info_for_single_dim_strategy.get(op_call)
    if schema_info is not None and schema_info.needs_pytree:
        return dispatcher._unwrap_to_op_info_impl(op_call, args, kwargs, True)
    specs, local_args, mesh = [], [], None
    for arg in args:
        kind = type(arg)
        if kind is DTensor:
            spec = arg._spec
            specs.append(spec)
            local_args.append(arg._local_tensor)
            if mesh is None:
                mesh = spec.mesh
        elif isinstance(arg, torch.Tensor) or ((kind is list or kind is tuple) and _holds_tensor(arg)):
            # plain tensors are replicated or refused, tensor lists flattened (pytree): PyTorch's path
            return dispatcher._unwrap_to_op_info_impl(op_call, args, kwargs, True)
        else:
            specs.append(arg)
            local_args.append(arg)
    if kwargs:
        for value in kwargs.values():
            if isinstance(value, torch.Tensor):
                return dispatcher._unwrap_to_op_info_impl(op_call, args, kwargs, True)
    if mesh is None:  # no DTensor among the positional arguments: PyTorch's path finds (or refuses) one
        return dispatcher._unwrap_to_op_info_impl(op_call, args, kwargs, True)
    return OpInfo(
        mesh,
        OpSchema(op_call, tuple(specs), dict(kwargs), schema_info=schema_info),
        specs,
        tuple(local_args),
        dict(kwargs),
        None,
    )


def install_unwrap() -> None:
    """Let DTensor's dispatcher use the shorter function (an attribute of its one instance)."""
    PATCHES.set_attr("dispatch.fast.unwrap", DTensor._op_dispatcher, "unwrap_to_op_info", unwrap_to_op_info)


def uninstall_unwrap() -> None:
    PATCHES.undo("dispatch.fast.unwrap")


