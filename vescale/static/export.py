"""export_plan(): what Static Eager recorded for a model, printed as plan statements.

One line per module boundary where a DTensor crossed (its placements before and after the plan's
hooks, and the placements its gradient came back in), one per parameter gradient that is not laid
out like its parameter (a Partial gradient waiting for reduction), and one ``plan.eager`` line per
module that must stay eager, with the reason.
"""

from __future__ import annotations

import torch.nn as nn

from ..plan.api import placement_str
from .install import static_runtime

__all__ = ["export_plan"]


def _fmt(placements) -> str:
    return "[" + ", ".join(placement_str(p) for p in placements) + "]" if placements else "-"


def export_plan(model: nn.Module) -> str:
    """The recorded static plan of ``model`` (parallelized with ``mode="static"`` and trained for at
    least one step) as text."""
    rt = static_runtime(model)
    rec = rt.latest()
    if rec is None:
        raise ValueError("nothing recorded yet: run one training step (forward and backward) first")
    names = dict(zip(("in", "body", "out", "result"), ("<in>", "<in>", "<out>", "<out>")))
    lines = ["# Static Eager plan recorded by vescale (placements per mesh dim; grad: gradient placements)"]
    for path in sorted(rt.forced_eager | set(rec.unsafe)):
        why = rec.unsafe.get(path, "plan.eager")
        lines.append(f"plan.eager({path!r})  # {why}")
    for (path, where, i), c in rec.crossings.items():
        if c.spec is None or where in ("in", "out"):
            continue
        tensor = f"{path}.{names[where]}[{i}]" if path else f"{names[where]}[{i}]"
        grad = f"  # grad: {_fmt(c.grad_placements)}" if c.grad_placements else ""
        lines.append(f"plan.annotate({tensor!r}, {_fmt(c.spec.placements)}){grad}")
    params = dict(model.named_parameters())
    for (path, name), g in rec.param_grads.items():
        full = f"{path}.{name}" if path else name
        p = params.get(full)
        if p is not None and tuple(getattr(p, "placements", ())) != tuple(g):
            lines.append(f"plan.annotate({full + '.grad'!r}, {_fmt(g)})")
    return "\n".join(lines)
