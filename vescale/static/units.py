"""ZeRO-3 units run as one in Static Eager steps.

Under ZeRO-3 every Linear and norm of a decoder layer has the plan's gather hooks, so none of them
is quiet (``program.find_quiet``), and each call pays its hooks on nn.Module's slow path, a
scheduler take, a parameter swap and a gradient hook on its output, although the layer's parameters
arrive in one collective for the whole unit. From a record's second static step on, members whose
hooks only gather lose their hooks like quiet modules, and the unit's module does it for all of
them at once: takes their gathered parameters before its body (as plain leaves), puts their own
back after it, frees the gathered ones and gathers the unit again when backward reaches its output.
The recording checks what that relies on: each member runs once, inside its unit's body, and
backward reaches the unit's output before any member's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from ..parallel.hooks import _register_once_on_grads, release_gathered
from ..parallel.zero import GatherScheduler
from .record import Record

__all__ = ["Units"]


@dataclass
class Units:
    """The ZeRO-3 units of a Static Eager model that gather for their members (``install_static``
    finds them), and what they hold in the step running now."""

    scheduler: GatherScheduler | None = None
    # unit -> {member path: (gather entries, ids of the plan's hooks on the member)}
    members: dict[str, dict] = field(default_factory=dict)
    unit_of: dict[str, str] = field(default_factory=dict)  # member path -> unit
    # This step: unit -> its quiet members, (path, module, gather entries); unit -> (gathered
    # parameters, what to put back) while its body runs.
    active: dict[str, list] = field(default_factory=dict)
    running: dict[str, tuple] = field(default_factory=dict)

    def note_call(self, rec: Record, path: str, stack: list) -> None:
        """While recording: ``path``, a member, runs; its unit runs as one only if each member runs
        once per step, inside the unit's own forward."""
        unit = self.unit_of[path]
        calls = rec.member_calls[path] = rec.member_calls.get(path, 0) + 1
        if calls > 1:
            rec.units_off.setdefault(unit, f"{path!r} runs more than once per step")
        elif unit not in stack:
            rec.units_off.setdefault(unit, f"{path!r} runs outside the unit's own forward")

    def member(self, rec: Record, path: str, inner: frozenset) -> tuple | None:
        """(unit, gather entries) if ``path``, whose hooks run ``inner`` (ids of the hooks it had before
        Static Eager's), can run as a quiet member of its unit in ``rec``'s static steps, else None."""
        unit = self.unit_of.get(path)
        if unit is None or unit in rec.units_off:
            return None
        if not rec.program[unit].static:
            return None
        entries, plan_ids = self.members[unit][path]
        if inner != plan_ids:
            return None  # other hooks than the plan's gathers
        return unit, entries

    def begin(self, rec: Record, quiet: dict) -> None:
        """A step begins: the units gather for their members that are quiet in it."""
        units = rec.quiet_units if quiet else None
        self.active = {u: [m for m in ms if m[0] in quiet] for u, ms in units.items()} if units else {}

    def quiet_members(self) -> set[str]:
        """The members whose unit swaps their parameters in this step."""
        return {m[0] for ms in self.active.values() for m in ms}

    def enter(self, unit: str, local_parameters: Callable[[nn.Module, str], list]) -> None:
        """The unit's module starts: its quiet members get their gathered parameters, then their local
        tensors (``local_parameters(module, path)`` swaps them and says what to put back)."""
        members = self.active.get(unit)
        if not members:
            return
        taken, restores = [], []
        for path, mod, entries in members:
            gathered = self.scheduler.take(mod, path, entries)
            params = mod._parameters
            own = [(e.tensor, params[e.tensor]) for e in entries]
            for e, g in zip(entries, gathered):
                params[e.tensor] = g.value
            restores.append((mod, own, local_parameters(mod, path)))
            taken += gathered
        self.running[unit] = (taken, restores)

    def exit(self, unit: str, output: Any, raised: bool, recompute: bool,
             put_back: Callable[[nn.Module, list], None]) -> None:
        """The unit's module is done (always called; ``raised``: forward raised): members get their own
        parameters back; the gathered ones are freed, and gathered again when backward reaches the
        unit's output."""
        state = self.running.pop(unit, None)
        if state is None:
            return
        taken, restores = state
        for mod, own, swapped in restores:
            put_back(mod, swapped)
            mod._parameters.update(own)
        if not raised:
            release_gathered(taken, output, self.scheduler, unit)
        elif not recompute:
            for g in taken:
                g.free()
        # (A recomputation stopped early, once it has saved what backward needs (checkpoint's early
        # stop), keeps them: the region's backward uses them next, as eager mode's does.)

    def swaps(self) -> list:
        """(module, swapped) of the members whose local parameters are in place now."""
        return [(mod, swapped) for _, restores in self.running.values() for mod, _, swapped in restores]

    @staticmethod
    def note_reached(rec: Record, unit: str, output: Any) -> None:
        """While recording: note when backward reaches the unit's output."""
        _register_once_on_grads(output, lambda: rec.unit_reached.add(unit))
