"""Quiet modules: no hooks in the static steps where a module has nothing to do at its boundary.

In a static step most modules (every Linear, norm, activation of a TP block) neither wrap, move nor
unwrap anything: their two hooks (``install.ModuleHooks``) only swap the parameters for local
tensors and back, and still cost nn.Module's slow call path and two Python calls per call. So from
a record's second static step on (the first checks local shapes through the hooks), such modules
lose their hooks for the step and the root swaps their parameters once for the whole forward; any
other state puts every hook back first. ``program.find_quiet`` decides which modules are
quiet; this module holds what silencing them changed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch.nn as nn

from vescale._torch import hooks_back, hooks_beyond, hooks_off

__all__ = ["QuietModules"]


@dataclass
class QuietModules:
    """The quiet modules of the step running now: their hooks taken off, their parameters swapped."""

    # path -> (module, the hook entries taken off it); None: a ZeRO-3 unit's hooks, kept on and quiet
    # (they only gather for its members).
    silenced: dict[str, tuple[nn.Module, list | None]] = field(default_factory=dict)
    swapped_at_root: list = field(default_factory=list)  # (module, swapped) for this forward

    def silence(self, quiet: dict, own_hooks: dict) -> None:
        """Take the hooks off the modules in ``quiet`` (path -> module), put them back on every other
        one. ``own_hooks``: path -> its ``ModuleHooks``."""
        # A module given a hook while silenced is not quiet any more.
        for path in [p for p, (m, saved) in self.silenced.items() if hooks_beyond(m, own_hooks[p].ids if saved is None else frozenset())]:
            quiet.pop(path, None)
        for path in [p for p in self.silenced if p not in quiet]:
            mod, saved = self.silenced.pop(path)
            if saved is None:
                own_hooks[path].quiet = False
            else:
                hooks_back(mod, saved)
        for path, mod in quiet.items():
            if path not in self.silenced:
                hooks = own_hooks[path]
                if hooks.unit:  # its hooks stay on and only gather for its quiet members (units.py)
                    hooks.quiet = True
                    self.silenced[path] = (mod, None)
                else:
                    self.silenced[path] = (mod, hooks_off(mod))

    def swap_at_root(self, quiet: dict, skip: set[str], local_parameters: Callable[[nn.Module, str], list]) -> None:
        """Each quiet module but those in ``skip`` gets its local parameters for the whole forward (its
        hooks would have swapped them at each call)."""
        for path, mod in quiet.items():
            if path in skip:
                continue
            swapped = local_parameters(mod, path)
            if swapped:
                self.swapped_at_root.append((mod, swapped))

    def restore_at_root(self, put_back: Callable[[nn.Module, list], None]) -> None:
        swaps, self.swapped_at_root = self.swapped_at_root, []
        for mod, swapped in swaps:
            put_back(mod, swapped)
