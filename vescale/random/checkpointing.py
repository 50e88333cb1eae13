"""Activation checkpointing (``torch.utils.checkpoint``) with vescale's generator.

Checkpointing drops a region's activations in forward and runs the region again in backward to
rebuild them, restoring PyTorch's own generators first so that its dropouts draw the forward's masks
again. vescale's generator (a seed and an offset, ``generator.py``) is not one of them: recomputed,
a region would draw the *next* numbers, and backward would use masks other than forward's (wrong
gradients, on the mesh and in a single-device run under ``consistent()`` alike). And the
recomputation runs inside ``loss.backward()``, outside a ``with consistent():`` block around the
forward, where plain tensors would draw from PyTorch's generator instead.

``checkpoint_context`` is the ``context_fn`` that fixes both: around the region's forward it notes
where the generator stands and whether ``consistent()`` is on; around the recomputation it puts
the generator there (and back afterwards) and turns ``consistent()`` on again if it was. A random
op that runs during backward without it raises (``generator.reserve``) rather than drawing other
numbers.
"""

from __future__ import annotations

from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from vescale.random import generator
from vescale.random.consistent import _ConsistentMode

__all__ = ["checkpoint_context"]


def _consistent_on() -> bool:
    return any(isinstance(m, _ConsistentMode) for m in _get_current_dispatch_mode_stack())


class _RegionStart:
    """Entered around a checkpointed region's forward: notes where the generator stands."""

    def __init__(self):
        self.at: tuple | None = None
        self.consistent = False

    def __enter__(self):
        self.at = (generator._state.seed, generator._state.offset)
        self.consistent = _consistent_on()

    def __exit__(self, *exc) -> None:
        pass


class _Replay:
    """Entered around the region's recomputation: the generator stands where it stood in the forward
    (and ``consistent()`` is on if it was), so every random op draws the forward's numbers."""

    def __init__(self, start: _RegionStart):
        self.start, self.saved, self.mode = start, None, None

    def __enter__(self):
        if self.start.at is None:
            raise RuntimeError("vescale.random.checkpoint_context: recomputing a region whose forward it did not see")
        state = generator._state
        self.saved = (state.seed, state.offset)
        state.seed, state.offset = self.start.at
        state.replaying += 1
        if self.start.consistent and not _consistent_on():
            self.mode = _ConsistentMode()
            self.mode.__enter__()

    def __exit__(self, *exc) -> None:
        if self.mode is not None:
            self.mode.__exit__(*exc)
            self.mode = None
        state = generator._state
        state.seed, state.offset = self.saved
        state.replaying -= 1


def checkpoint_context() -> tuple[_RegionStart, _Replay]:
    """``context_fn`` for ``torch.utils.checkpoint`` (``use_reentrant=False``): a checkpointed
    region's recomputation draws the numbers its forward drew from vescale's generator.

    ``torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False, context_fn=checkpoint_context)``;
    for HuggingFace models ``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=
    {"use_reentrant": False, "context_fn": vescale.random.checkpoint_context})``."""
    start = _RegionStart()
    return start, _Replay(start)
