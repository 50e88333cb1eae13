"""What vescale holds for a model it parallelised: one typed object per model, not attributes on it.

``parallelize`` (and ``apply_mixed_precision`` for a plain model) fill a ``ModelState``; the rest of
vescale reads it through ``state_of(model)``. The states live in a weak table keyed by the model, so
they go when the model goes and ``model.__dict__`` holds nothing of vescale's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.utils.weak import WeakIdKeyDictionary


__all__ = ["ModelState", "state_of", "WeakStates"]


class WeakStates:
    """One state object per key (a module, a parameter, an optimiser), made by ``make()`` on first
    use and kept in a weak table: vescale's typed state, without attributes on the key. Keyed by
    identity (a tensor's ``==`` compares values)."""

    def __init__(self, make):
        self._make = make
        self._table = WeakIdKeyDictionary()

    def __call__(self, key):
        state = self._table.get(key)
        if state is None:
            state = self._table[key] = self._make()
        return state

    def peek(self, key: object) -> Any:
        """``key``'s state if one was made, else None (makes none)."""
        return self._table.get(key)


@dataclass
class ModelState:
    """A parallelised model's plan and runtime objects (None where not in use)."""

    ir: Any = None  # the lowered plan (vescale.plan.PlanIR); None: not parallelised
    mesh: Any = None  # the DeviceMesh it was parallelised on
    handles: list = field(default_factory=list)  # hook handles parallelize installed
    reducer: Any = None  # vescale.comm.GradReducer (bucketed gradient reduction), or None
    step_check: Any = None  # vescale.parallel.faults.StepCheck
    gathers: Any = None  # vescale.parallel.zero.GatherScheduler (ZeRO-3), or None
    mixed_precision: Any = None  # vescale.MixedPrecision, or None
    mixed_precision_handles: list = field(default_factory=list)  # apply_mixed_precision's hooks (one device)
    static: Any = None  # vescale.static.StaticRuntime (mode="static"), or None


# ``state_of(model)``: the model's state; an empty one (``ir`` None) for a model vescale has not parallelised.
state_of = WeakStates(ModelState)
