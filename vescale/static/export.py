"""export_plan(): what Static Eager recorded for a model, as plan statements a user can keep.

The recording step (``runtime.py``) learns, for every module boundary, how each DTensor crossing it
was laid out before and after the plan's hooks, and how its gradient came back; for every parameter,
how its gradient was laid out before vescale reduced it; and which modules must stay on DTensors.
This module prints that as Plan API calls:

* ``plan.redistribute(path, src, dst, grad_src=..., grad_dst=...)`` where the plan moved a tensor
  (``grad_src`` / ``grad_dst`` only where the gradient was not laid out as DTensor's default),
* ``plan.annotate(path, placements)`` where a DTensor crossed unmoved,
* ``plan.annotate("<parameter>.grad", placements)`` for gradients laid out unlike their parameter
  (a ``Partial`` gradient waiting for reduction),
* ``plan.eager(path)`` for each module that must stay eager, with the reason;
* a comment for each ``view`` / ``reshape`` call whose global size static steps rewrite to the local
  one (``local_sizes.py``): not a statement (the recording finds them), but what static mode does.

Every statement is full-mesh (one placement per mesh dim) and escaped, so the text can be pasted into
the plan (``exec`` with ``plan`` and the placement classes in scope): the statements agree with what
the plan does, so the model trains exactly as before; an edit that disagrees with the model (a wrong
source placement, a gradient annotation the model does not produce) is an error naming the statement.
"""

from __future__ import annotations

import re

import torch.nn as nn

from ..parallel.placing import grad_layout
from .install import static_runtime
from .local_sizes import GlobalSizes
from vescale.model_state import state_of

__all__ = ["export_plan", "eager_modules"]

# Where a crossing sits relative to the plan's hooks: the side before them and the side after.
_SIDES = {"in": ("in", "body"), "out": ("out", "result")}


def _code(p) -> str:
    """A placement as Python code (``Shard(1)``, ``Partial()``, ``InterleavedShard(0, 3)``)."""
    from ..placement import interleave_of, is_interleaved

    if is_interleaved(p):
        return f"InterleavedShard({p.dim}, {interleave_of(p)})"
    if p.is_shard():
        return f"Shard({p.dim})"
    if p.is_partial():
        return "Partial()" if p.reduce_op == "sum" else f"Partial({p.reduce_op!r})"
    return "Replicate()"


def _codes(placements) -> str:
    return "[" + ", ".join(_code(p) for p in placements) + "]"


def _path(module: str, direction: str, key) -> str:
    where = f"<{direction}>[{key}]"
    return re.escape(module) + r"\." + re.escape(where) if module else re.escape(where)


def _latest(model: nn.Module):
    rt = static_runtime(model)
    rec = rt.latest()
    if rec is None:
        raise ValueError("nothing recorded yet: run one training step (forward and backward) first")
    return rt, rec


def eager_modules(model: nn.Module) -> dict[str, str]:
    """The modules of ``model`` (parallelized with ``mode="static"`` and trained for at least one
    step) that run on DTensors in static steps, by path, with why: ``"plan.eager"`` for those the
    plan keeps eager, else what the recording found (the op that cannot run on local shards)."""
    rt, rec = _latest(model)
    return {path: rec.unsafe.get(path, "plan.eager") for path in sorted(rt.forced_eager | set(rec.unsafe))}


def export_plan(model: nn.Module) -> str:
    """The recorded static plan of ``model`` (parallelized with ``mode="static"`` and trained for at
    least one step) as plan code; see the module docstring."""
    _, rec = _latest(model)
    lines = ["# Static Eager plan recorded by vescale: placements per mesh dim " + str(tuple(_mesh_names(rec)))]
    for path, why in eager_modules(model).items():
        lines.append(f"plan.eager({re.escape(path)!r})  # {why}")
    lines += _boundary_lines(rec, state_of(model).mesh)
    lines += _grad_lines(model, rec)
    lines += _size_lines(rec)
    return "\n".join(lines)


def _size_lines(rec) -> list[str]:
    lines = []
    for path, notes in rec.sizes.items():
        for k, r in enumerate(notes):
            if r is None or not r.positions:  # nothing rewritten (yet)
                continue
            sizes = ["*"] * r.ndim
            local = ["*"] * r.ndim
            for i, g, n in zip(r.positions, r.global_sizes, r.local_sizes):
                sizes[i], local[i] = str(g), str(n)
            if isinstance(r, GlobalSizes):
                lines.append(f"# module {path!r}, sized call #{k} on a plain tensor: static steps pass the global "
                             f"({', '.join(sizes)}) for ({', '.join(local)}) (vescale.static.local_sizes)")
            else:
                lines.append(f"# module {path!r}, sized call #{k}: static steps pass ({', '.join(local)}) for the global "
                             f"({', '.join(sizes)}) (vescale.static.local_sizes)")
    return lines


def _mesh_names(rec) -> tuple:
    for c in rec.crossings.values():
        if c.spec is not None:
            return c.spec.mesh.mesh_dim_names or ()
    return ()


def _boundary_lines(rec, mesh) -> list[str]:
    lines, skipped, local = [], 0, 0
    done = set()
    for (module, where, i) in list(rec.crossings):
        direction = "in" if where in ("in", "body") else "out"
        if (module, direction, i) in done:
            continue
        done.add((module, direction, i))
        before, after = (rec.crossings.get((module, side, i)) for side in _SIDES[direction])
        keys = rec.keys.get((module, direction), [])
        key = keys[i] if i < len(keys) else None
        specs = [c.spec for c in (before, after) if c is not None and c.spec is not None]
        if not specs:
            continue  # plain tensors: nothing to say
        if any(spec.mesh != mesh for spec in specs):
            local += 1  # at or inside a plan.batch_local module: on the sub-mesh, which that statement sets up
            continue
        if key is None or before is None or after is None or before.spec is None:
            skipped += 1  # inside a container, or made a DTensor by the plan from a plain tensor
            continue
        path = _path(module, direction, key)
        src, dst = tuple(before.spec.placements), tuple(after.spec.placements)
        if src == dst:
            lines.append(f"plan.annotate({path!r}, {_codes(dst)})")
            continue
        grads = ""
        if after.grad_placements and tuple(after.grad_placements) != grad_layout(dst):
            grads += f", grad_src={_codes(after.grad_placements)}"
        if before.grad_placements and tuple(before.grad_placements) != grad_layout(src):
            grads += f", grad_dst={_codes(before.grad_placements)}"
        lines.append(f"plan.redistribute({path!r}, {_codes(src)}, {_codes(dst)}{grads})")
    if skipped:
        lines.append(f"# {skipped} more DTensor crossing(s) inside containers or made by the plan from plain tensors: not expressible as one statement")
    if local:
        lines.append(f"# {local} more DTensor crossing(s) at or inside plan.batch_local modules (on the sub-mesh that statement sets up)")
    return lines


def _grad_lines(model: nn.Module, rec) -> list[str]:
    params = dict(model.named_parameters())
    lines = []
    for (path, name), g in rec.param_grads.items():
        full = f"{path}.{name}" if path else name
        p = params.get(full)
        if p is not None and len(g) != len(getattr(p, "placements", g)):
            continue  # used inside a plan.batch_local module: its gradient there is on the sub-mesh
        if p is not None and tuple(getattr(p, "placements", ())) != tuple(g):
            lines.append(f"plan.annotate({re.escape(full) + re.escape('.grad')!r}, {_codes(g)})")
    return lines
