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

Other state a recomputation must find as the region's forward left it registers here
(``listen_to_regions``): Static Eager mode's runtime notes which module body ran the region and where
its random replay and local calls stood (``vescale.static.recompute``). ``checkpoint_context(policy=...)``
adds PyTorch's selective checkpointing (``create_selective_checkpoint_contexts``) to the same region.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

from vescale._torch import _get_current_dispatch_mode_stack

from vescale.random import generator
from vescale.random.consistent import _ConsistentMode

__all__ = ["checkpoint_context", "listen_to_regions"]

# Objects with ``region_start()``, called as each checkpointed region's forward begins: it returns
# None or a ``RegionState`` (``forward_done()`` when the region's forward ends, ``recompute()`` a
# context manager entered around its recomputation). Weak: a dropped model takes its runtime along.
_listeners: "weakref.WeakSet" = weakref.WeakSet()


def listen_to_regions(listener: object) -> None:
    """Have ``listener.region_start()`` called at the start of every checkpointed region's forward
    run under ``checkpoint_context`` (vescale.static's runtime registers itself)."""
    _listeners.add(listener)


def _consistent_on() -> bool:
    return any(isinstance(m, _ConsistentMode) for m in _get_current_dispatch_mode_stack())


class _RegionStart:
    """Entered around a checkpointed region's forward: notes where the generator stands."""

    def __init__(self):
        self.at: tuple | None = None
        self.consistent = False
        self.states: list = []  # the listeners' RegionStates for this region

    def __enter__(self):
        self.at = (generator._state.seed, generator._state.offset)
        self.consistent = _consistent_on()
        self.states = [s for s in (listener.region_start() for listener in list(_listeners)) if s is not None]

    def __exit__(self, *exc) -> None:
        for state in self.states:
            state.forward_done()


class _Replay:
    """Entered around the region's recomputation: the generator stands where it stood in the forward
    (and ``consistent()`` is on if it was), so every random op draws the forward's numbers."""

    def __init__(self, start: _RegionStart):
        self.start, self.mode = start, None
        self.saved: tuple | None = None  # (seed, offset) while the region replays
        self.recomputes: list = []

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
        self.recomputes = [s.recompute() for s in self.start.states]
        for r in self.recomputes:
            r.__enter__()

    def __exit__(self, *exc) -> None:
        for r in reversed(self.recomputes):
            r.__exit__(*exc)
        self.recomputes = []
        if self.mode is not None:
            self.mode.__exit__(*exc)
            self.mode = None
        state = generator._state
        state.seed, state.offset = self.saved
        state.replaying -= 1


class _Both:
    """Two context managers as one: entered in order, exited in reverse."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __enter__(self):
        self.first.__enter__()
        try:
            self.second.__enter__()
        except BaseException:
            self.first.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.second.__exit__(*exc)
        finally:
            self.first.__exit__(*exc)


def checkpoint_context(policy: Callable[..., Any] | Sequence[Any] | None = None) -> tuple:
    """``context_fn`` for ``torch.utils.checkpoint`` (``use_reentrant=False``): a checkpointed
    region's recomputation draws the numbers its forward drew from vescale's generator (and, in
    Static Eager mode, runs from the state its forward started in: ``vescale.static.recompute``).

    ``torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False, context_fn=checkpoint_context)``;
    for HuggingFace models ``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=
    {"use_reentrant": False, "context_fn": vescale.random.checkpoint_context})``.

    ``policy``: selective checkpointing, PyTorch's ``create_selective_checkpoint_contexts(policy)``
    in the same region (a policy function or a list of ops to save):
    ``context_fn=functools.partial(vescale.random.checkpoint_context, policy=policy_fn)``."""
    start = _RegionStart()
    forward, recompute = start, _Replay(start)
    if policy is not None:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        sac_forward, sac_recompute = create_selective_checkpoint_contexts(policy)
        forward, recompute = _Both(forward, sac_forward), _Both(recompute, sac_recompute)
    return forward, recompute
