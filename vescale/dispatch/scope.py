"""Which DTensors vescale's op handlers answer for, and how they hand a call back to PyTorch.

vescale's handlers in DTensor's per-op table (random ops, ``item()``, loss means over a split
batch, CPU attention, convolutions, data-dependent ops) give single-device semantics and coverage
to the DTensors of the models vescale parallelized: those on a mesh it was given
(``vescale.mesh.adopt_mesh``). A DTensor program on any other mesh in the same process gets
PyTorch's own handling of the call, as if vescale were not installed. (The sized-op handler is a
fast path that replays PyTorch's own decisions, and the sharding strategies and caches stay
process-wide: docs/architecture.md, "Changes to PyTorch".)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch.distributed.tensor import DTensor

from vescale._torch import PATCHES
from vescale.mesh import is_vescale_mesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["DTensorRule", "for_vescale_meshes", "mesh_of_call", "pytorch_handling"]


class DTensorRule:
    """Call ``op`` with PyTorch's own entry for it in DTensor's handler table (usually none, so
    DTensor's sharding rule runs) in place of vescale's, which is back afterwards."""

    def __init__(self, op: Any) -> None:
        self.op = op

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with PATCHES.original("item", DTensor._op_dispatcher._custom_op_handlers, self.op):
            return self.op(*args, **kwargs)


def pytorch_handling(op: Any, args: tuple, kwargs: dict | None) -> object:
    """What DTensor does with the call without vescale's handler for ``op``."""
    return DTensorRule(op)(*args, **(kwargs or {}))


def mesh_of_call(args: Sequence[Any], kwargs: dict | None) -> DeviceMesh | None:
    """The mesh of the call's first DTensor argument (in a list too: ``cat``'s), or None."""
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, DTensor):
            return value.device_mesh
        if isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, DTensor):
                    return item.device_mesh
    return None


def for_vescale_meshes(handler: Callable | None = None, *, elsewhere: Callable = pytorch_handling) -> Callable:
    """Decorate a DTensor op handler so that it answers only for DTensors on vescale's meshes;
    a call on another mesh goes to ``elsewhere`` (PyTorch's own handling). The decorated function
    keeps the handler's name, and it is what gets registered and declared (``runs_locally_when``)."""

    def decorate(handler: Callable) -> Callable:
        @functools.wraps(handler)
        def scoped(op: Any, args: tuple, kwargs: dict | None) -> object:
            mesh = mesh_of_call(args, kwargs)
            if mesh is None or is_vescale_mesh(mesh):
                return handler(op, args, kwargs)
            return elsewhere(op, args, kwargs)

        return scoped

    return decorate if handler is None else decorate(handler)
