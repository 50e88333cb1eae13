"""A cheaper steady-state path for DTensor ops that take sizes (``view``, ``_unsafe_view``, ``expand``,
``slice_backward``, ``new_zeros``, ...).

DTensor rewrites the size arguments of these ops from global to local sizes when the output is
sharded (``ShardingPropagator.op_to_shape_and_stride_idx``). In PyTorch 2.13 such a decision carries
a rewritten schema, so even a hit of the sharding cache leaves DTensor's C++ fast path for its
Python slow path (``unwrap_to_op_info``, ``redistribute_local_args`` over the arguments, the
unflatten and re-wrap): ~40 us per call on CPU against ~13 us for an op without size arguments.
A transformer runs dozens of them per layer (every linear's ``view`` / ``_unsafe_view``, the head
split and merge, autograd's views in backward).

``sized_op_handler`` answers a repeated call from its own table, keyed by the op, every argument
(``DTensorSpec``s with their global shapes, strides and placements; sizes; scalars) and the keyword
arguments: the value is PyTorch's own decision for that call, taken from its propagator the first
time (``propagate_op_sharding``: PyTorch's cache, vescale's shape-free cache behind it). Only a
decision that moves no input is kept: the handler then runs the op on the local tensor with the
local sizes that decision wrote, and wraps the result in the decision's output spec, as DTensor's
own path does (views keep their storage aliasing, ``return_and_correct_aliasing``). Anything else
— a decision that redistributes an input (an uneven split gathered first), plain tensor arguments,
symbolic sizes — runs PyTorch's own slow path, unchanged.

The handler computes no decision of its own, so it gives PyTorch's answers bit for bit
(``tests/dispatch/test_sized_ops.py`` compares placements, local shapes, values and gradients with
the handler installed and not). Static Eager asks ``local.handler_runs_locally`` (the same question it asks every
op: ``why_rule_not_local``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from vescale._torch import DTensorSpec, OutputSharding, return_and_correct_aliasing, PATCHES

from ..local import runs_locally_when, why_rule_not_local
from vescale.memo import Memo

__all__ = ["sized_op_handler", "install_sized_ops", "uninstall_sized_ops", "clear_sized_ops_table"]

_SLOW = object()  # a key whose decision moves an input: PyTorch's own path each time
# Entries are a few hundred bytes; a run with many sequence lengths makes new keys (global sizes are
# part of them, as in PyTorch's own cache): bounded. Like PyTorch's caches, entries hold this rank's
# local sizes (uneven shards differ by rank) and the key does not name the rank:
# ``vescale.testing.forget_dtensor_caches`` empties it with theirs.
_TABLE = Memo("sized-op decisions", 8192)
_OWNER = "dispatch.fast.sized"


def _key(op, args, kwargs):
    """The table key of a call: the op, each DTensor's spec (global shape, stride, placements, mesh),
    each size list as a tuple, each other argument with its type (``1``, ``1.0`` and ``True`` are
    equal keys, not equal arguments), the keyword arguments. None if a plain tensor is an argument."""
    parts = [op]
    for a in args:
        if isinstance(a, DTensor):
            parts.append(a._spec)
        elif type(a) is list or type(a) is tuple:
            parts.append(tuple(a))  # the schemas of these ops take int lists only
        elif isinstance(a, torch.Tensor):
            return None
        else:
            parts.append((type(a), a))
    if kwargs:
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                return None
            parts.append((k, type(v), v))
    return tuple(parts)


def _decide(op, args, kwargs):
    """PyTorch's decision for this call, as its C++ dispatcher gets it on a miss of its own cache
    (vescale's shape-free cache and strict-view rule included): an ``OutputSharding``, or the
    output itself where PyTorch decomposes the op instead (CompositeImplicit ops in inference mode)."""
    dispatcher = DTensor._op_dispatcher
    info = dispatcher.unwrap_to_op_info(op, args, kwargs)
    return info, dispatcher._propagate_op_sharding_dispatch_slow_path(op, args, kwargs, info, try_cache=False)


def _learn(op, args, kwargs, info, sharding):
    """The table entry: (output spec, local arguments, DTensor argument slots, is a view op) when the
    decision moves no input, else ``(_SLOW, sharding)``."""
    slow = (_SLOW, sharding)
    spec = sharding.output_spec
    if not isinstance(spec, DTensorSpec) or info.args_tree_spec is not None:
        return slow
    if not info.compute_mesh._is_current_rank_part_of_mesh():
        return slow
    template = tuple(info.schema.args_schema)
    if sharding.needs_redistribute:
        target = sharding.redistribute_schema
        if target is None or target.op is not op or len(target.args_schema) != len(template):
            return slow
        for given, wanted in zip(template, target.args_schema):
            if isinstance(given, DTensorSpec) != isinstance(wanted, DTensorSpec):
                return slow
            if isinstance(given, DTensorSpec) and given != wanted:
                return slow  # an input is redistributed: PyTorch's path
        if sharding.use_val_from_redistribute_schema:
            template = tuple(target.args_schema)
    slots = tuple(i for i, a in enumerate(args) if isinstance(a, DTensor))
    return spec, template, slots, op._schema._is_view_op()


def _wrapped(op, args, kwargs, local, spec, is_view):
    out = DTensor._op_dispatcher.wrap(local, spec)
    return return_and_correct_aliasing(op, args, kwargs, out) if is_view else out


def _slow_path(op, args, kwargs, sharding=None):
    """DTensor's own Python path (what its C++ dispatcher runs for these ops), with a known decision
    or deciding now."""
    dispatcher = DTensor._op_dispatcher
    if sharding is None:
        info, sharding = _decide(op, args, kwargs)
        if not isinstance(sharding, OutputSharding):
            return sharding  # decomposed and run by PyTorch
    else:
        info = dispatcher.unwrap_to_op_info(op, args, kwargs)
    info.output_sharding = sharding
    local = dispatcher._dispatch_get_local_results_slow_path(op, args, info)
    view = op._schema._is_view_op() and info.compute_mesh._is_current_rank_part_of_mesh()
    return _wrapped(op, args, kwargs, local, sharding.output_spec, view)


def sized_op_handler(op: Any, args: tuple, kwargs: dict | None) -> object:
    """DTensor handler for an op with size arguments: PyTorch's decision replayed from the table."""
    kwargs = kwargs or {}
    key = _key(op, args, kwargs)
    entry = _TABLE.get(key) if key is not None else None
    if entry is None:
        info, sharding = _decide(op, args, kwargs)
        if not isinstance(sharding, OutputSharding):
            return sharding
        entry = _learn(op, args, kwargs, info, sharding)
        if key is not None:
            _TABLE.put(key, entry)
    if entry[0] is _SLOW:
        return _slow_path(op, args, kwargs, entry[1])
    spec, template, slots, is_view = entry
    local_args = list(template)
    for i in slots:
        local_args[i] = args[i]._local_tensor
    local = op(*local_args, **kwargs)
    out = DTensor(local, spec, requires_grad=local.requires_grad)
    return return_and_correct_aliasing(op, args, kwargs, out) if is_view else out


def _runs_locally(op, args, kwargs) -> bool:
    return why_rule_not_local(op, args, kwargs) is None


runs_locally_when(sized_op_handler, _runs_locally)


def install_sized_ops() -> None:
    """Put the handler in DTensor's per-op table for every op with size arguments that has no
    handler yet (idempotent)."""
    dispatcher = DTensor._op_dispatcher
    if PATCHES.owners(_OWNER):
        return
    for op in dispatcher.sharding_propagator.op_to_shape_and_stride_idx:
        if op not in dispatcher._custom_op_handlers:
            PATCHES.set_item(_OWNER, dispatcher._custom_op_handlers, op, sized_op_handler, f"DTensor custom handler {op}")


def clear_sized_ops_table() -> None:
    _TABLE.clear()


def uninstall_sized_ops() -> None:
    PATCHES.undo(_OWNER)
    clear_sized_ops_table()


