"""``consistent()``: make a single-device script draw the numbers a distributed run draws.

Inside ``with vescale.random.consistent():`` every supported random op on a plain tensor draws the
whole tensor from vescale's generator (the tensor *is* the global tensor), and random ops on DTensors
go to vescale's DTensor handlers even where :func:`vescale.random.install` was not called. So the
same script, with the same ``vescale.manual_seed``, gives bit-identical random tensors on one device
and, gathered, on any mesh and placements.

Outside the block plain tensors use PyTorch's own generators as usual. Inside it, a call given an
explicit ``generator=`` still draws from that generator (it is the user's), and random ops vescale
cannot reproduce (exponential_, multinomial, randperm, ...) raise instead of drawing numbers no
distributed run could match. Random draws hidden inside fused kernels (attention or RNN dropout)
are not seen by the mode and use PyTorch's generator.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from vescale.dispatch.scope import mesh_of_call
from vescale.mesh import is_vescale_mesh
from vescale.random import dtensor, ops

__all__ = ["consistent"]


class _ConsistentMode(ops.RandomOpMode):
    def on_dtensor(self, func: Any, args: tuple, kwargs: dict | None) -> Any:
        if func in ops.UNSUPPORTED:
            raise ops.unsupported_error(func)
        mesh = mesh_of_call(args, kwargs)
        if dtensor.is_installed() and (mesh is None or is_vescale_mesh(mesh)):
            # DTensor's dispatch reaches the same handler; passing the op down also lets the
            # dispatch modes beneath this one see it (Static Eager's recording notes which modules
            # draw random numbers there, and replays their draws on local shards in static steps).
            return func(*args, **kwargs)
        return dtensor.draw_shard(func, args, kwargs)  # any mesh: the block asks for vescale's numbers


@contextlib.contextmanager
def consistent() -> Iterator[None]:
    """Draw random ops on plain tensors (and DTensors) from vescale's generator inside the block."""
    with _ConsistentMode():
        yield
