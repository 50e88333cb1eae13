"""Which calls of a static step draw random numbers: the random replay's dispatch mode is on for those only.

A static module that draws (dropout) gets its random ops replayed through vescale.random with the
specs recorded for them (``_RandomReplay`` in ``runtime.py``, a ``TorchDispatchMode``). A dispatch
mode costs every aten op it sees a Python call through the dispatcher's boxed path, about 20 us on
the CPU, and a decoder layer's body (attention with its projections, the residual adds) is some
eighty ops of which one or two draw. A ``TorchFunctionMode`` sees the same body as the torch
functions the model calls, for about 5 us each, and knows which function is running.

So the first static step of a record (which runs the replay over whole drawing bodies, as before)
also *learns*, with ``CallTracker``, which torch functions the drawing ops came from (``F.dropout``
in the zoo LLaMA): the outermost function running when each random aten op reached the replay
(a torch function mode is off while its own handler runs, so nested calls do not reach it). Later
static steps run the drawing bodies under ``RandomGate`` instead, which switches the replay's
dispatch mode on around calls of those functions and lets every other call straight through. If a
random op came from no torch function (an aten overload called directly), nothing is gated: the
record keeps the replay over whole bodies. A gated step counts the draws of every module against
the recording and fails, naming the module, if one drew fewer (a random function it did not call in
the learning step, or a changed op sequence, which static mode does not support anyway).
"""

from __future__ import annotations

from typing import Callable

from torch.overrides import TorchFunctionMode
from vescale._torch import exit_function_mode

__all__ = ["SwitchedMode", "CallTracker", "RandomGate"]


class SwitchedMode(TorchFunctionMode):
    """A torch function mode switched on and off as the running module body changes (``switch``):
    on the mode stack only while it is on."""

    on = False

    def switch(self, on: bool) -> None:
        if on != self.on:
            self.on = on
            if on:
                self.__enter__()
            else:
                exit_function_mode(self)


class CallTracker(SwitchedMode):
    """Learning step: the torch function running now (``current``); ``note_draw`` records it as one
    that draws, or that a draw came from outside any function (``untracked``)."""

    def __init__(self):
        super().__init__()
        self.current = None
        self.drawing: set = set()
        self.untracked = False

    def note_draw(self) -> None:
        if self.current is None:
            self.untracked = True
        else:
            self.drawing.add(self.current)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.current = func
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.current = None


class RandomGate(SwitchedMode):
    """Gated steps: on while a drawing body runs; ``replay_on(True/False)`` around calls of ``funcs``."""

    def __init__(self, funcs: frozenset, replay_on: Callable[[bool], None]):
        super().__init__()
        self.funcs, self.replay_on = funcs, replay_on

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.funcs:
            return func(*args, **kwargs)
        self.replay_on(True)
        try:
            return func(*args, **kwargs)
        finally:
            self.replay_on(False)
