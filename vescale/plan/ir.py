"""Plan IR: what parallelize() will do to a model, one printable entry per tensor and hook.

Lowering (``vescale.plan.lower``) turns each plan statement into *raw* entries, one per matched
tensor and mesh dimension. ``optimize`` then

  * fuses the raw entries that share (module, hook, tensor) into one entry covering the whole mesh,
  * drops duplicates (two statements asking for the same placement),
  * rejects conflicts (two statements asking for different placements of one tensor, mesh
    dimension and phase) with an error quoting both statements,
  * derives RUN-phase gathers (ZeRO-3) where a parameter's RUN placement differs from its INIT one,
  * orders entries validly: module order of ``named_modules()``, then hook order.

Printed entries follow the paper, e.g. ``layers.0.mlp.forward_pre:<in>:0:redist(->R,TP)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from torch.distributed.tensor import Placement, Replicate

from .api import Phase, Statement, placement_str

__all__ = ["RawEntry", "Entry", "PlanIR", "optimize", "PlanError"]


class PlanError(ValueError):
    """A plan that does not fit the model or the mesh."""


# Hooks in the order they act on a module.
HOOK_ORDER = {"param": 0, "factory": 1, "forward_pre": 2, "forward": 3}


@dataclass(frozen=True)
class RawEntry:
    """One statement's effect on one tensor along one mesh dimension."""

    module: str  # owning module path ("" = root)
    hook: str  # "param" | "factory" | "forward_pre" | "forward"
    tensor: str  # parameter/buffer name, "<in>", "<out>" or "<factory>"
    key: object  # input/output key (int position or str name); None for parameters
    mesh_dim: int
    placement: Placement
    phase: Optional[Phase]  # parameters only: INIT / RUN
    statement: Statement

    @property
    def name(self) -> str:
        """Full tensor path of a parameter/buffer entry."""
        return f"{self.module}.{self.tensor}" if self.module else self.tensor


Targets = tuple[Optional[Placement], ...]  # one per mesh dim; None = leave as is


@dataclass
class Entry:
    """A fused IR entry: the full-mesh action on one tensor at one hook."""

    module: str
    hook: str
    tensor: str
    key: object
    action: str  # "distribute" | "gather" | "redist" | "factory"
    targets: Targets
    sources: Targets | None = None  # gather: the INIT placements it gathers from
    statements: tuple[int, ...] = ()
    mesh_dim_names: tuple[str, ...] = field(default=(), repr=False)

    def _fmt(self, targets: Targets) -> str:
        parts = [
            f"{placement_str(p)},{name}"
            for p, name in zip(targets, self.mesh_dim_names)
            if p is not None
        ]
        return "; ".join(parts) if parts else "-"

    def __str__(self) -> str:
        where = f"{self.module}.{self.hook}" if self.module else self.hook
        key = "" if self.key is None else self.key
        if self.action == "gather":
            body = f"gather({self._fmt(self.sources)}->{self._fmt(self.targets)})"
        else:
            arrow = "" if self.action == "distribute" else "->"
            body = f"{self.action}({arrow}{self._fmt(self.targets)})"
        return f"{where}:{self.tensor}:{key}:{body}"


@dataclass
class PlanIR:
    """The lowered plan: raw entries as lowered, and the optimised entries hooks are made from."""

    raw: list[RawEntry]
    entries: list[Entry]
    mesh_dim_names: tuple[str, ...]

    def hooks(self) -> dict[tuple[str, str], list[Entry]]:
        """Entries grouped per (module, hook); each group becomes one installed hook. "param"
        entries are not hooks: parallelize applies them once."""
        grouped: dict[tuple[str, str], list[Entry]] = {}
        for e in self.entries:
            if e.hook != "param":
                grouped.setdefault((e.module, e.hook), []).append(e)
        return grouped

    def __str__(self) -> str:
        head = (
            f"# Plan IR: {len(self.raw)} raw entries -> {len(self.entries)} entries in "
            f"{len(self.hooks())} hooks; mesh dims {self.mesh_dim_names}"
        )
        return "\n".join([head] + [str(e) for e in self.entries])

    __repr__ = __str__


def _fuse(group: list[RawEntry], ndim: int, what: str) -> tuple[Targets, tuple[int, ...]]:
    """Merge per-dim raw entries into one target per mesh dim, rejecting conflicts."""
    chosen: list[Optional[RawEntry]] = [None] * ndim
    for e in group:
        prev = chosen[e.mesh_dim]
        if prev is None:
            chosen[e.mesh_dim] = e
        elif prev.placement != e.placement:
            raise PlanError(
                f"conflicting placements for {what}: {prev.statement} asks for "
                f"{placement_str(prev.placement)} but {e.statement} asks for "
                f"{placement_str(e.placement)}; keep one of them (or narrow one path)"
            )
        # else: a duplicate of an earlier statement, dropped
    targets = tuple(c.placement if c else None for c in chosen)
    stmts = tuple(sorted({e.statement.index for e in group}))
    return targets, stmts


def _param_entries(
    name: str, group: list[RawEntry], ndim: int, names: tuple[str, ...]
) -> list[Entry]:
    """INIT placement (distribute at parallelize time) and, if RUN differs, a gather before use."""
    module, _, tensor = name.rpartition(".")
    by_phase = {ph: [e for e in group if e.phase is ph] for ph in Phase}
    label = f"parameter {name!r}"
    init, s1 = _fuse(by_phase[Phase.INIT], ndim, f"{label} (phase INIT)")
    run, s2 = _fuse(by_phase[Phase.RUN], ndim, f"{label} (phase RUN)")
    # A dimension given for one phase only holds in both; unplanned dimensions are Replicate.
    init_full = tuple(i or r or Replicate() for i, r in zip(init, run))
    run_full = tuple(r or i or Replicate() for i, r in zip(init, run))
    stmts = tuple(sorted(set(s1) | set(s2)))
    out = [Entry(module, "param", tensor, None, "distribute", init_full, None, stmts, names)]
    if run_full != init_full:
        out.append(
            Entry(module, "forward_pre", tensor, None, "gather", run_full, init_full, stmts, names)
        )
    return out


def optimize(
    raw: list[RawEntry],
    param_names: list[str],
    module_order: dict[str, int],
    mesh_dim_names: tuple[str, ...],
) -> PlanIR:
    """Fuse, de-duplicate, check and order raw entries (see module docstring)."""
    ndim = len(mesh_dim_names)
    params: dict[str, list[RawEntry]] = {n: [] for n in param_names}
    acts: dict[tuple, list[RawEntry]] = {}
    for e in raw:
        if e.hook == "param":
            params[e.name].append(e)
        else:
            acts.setdefault((e.module, e.hook, e.tensor, e.key), []).append(e)

    entries: list[Entry] = []
    for name, group in params.items():
        entries += _param_entries(name, group, ndim, mesh_dim_names)
    for (module, hook, tensor, key), group in acts.items():
        what = f"{tensor}[{key}] of module {module or '<root>'!r}" if key is not None else f"{tensor} of module {module or '<root>'!r}"
        targets, stmts = _fuse(group, ndim, what)
        action = "factory" if hook == "factory" else "redist"
        entries.append(Entry(module, hook, tensor, key, action, targets, None, stmts, mesh_dim_names))

    # Stable: within a hook, parameters keep named_parameters() order and activations plan order.
    entries.sort(key=lambda e: (module_order.get(e.module, -1), HOOK_ORDER[e.hook]))
    return PlanIR(raw=list(raw), entries=entries, mesh_dim_names=mesh_dim_names)
