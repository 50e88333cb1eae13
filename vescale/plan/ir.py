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

__all__ = ["RawEntry", "Entry", "PlanIR", "optimize", "ordered", "PlanError"]


class PlanError(ValueError):
    """A plan that does not fit the model or the mesh."""


# Hooks in the order they act on a module ("grad": a parameter gradient's annotated placements).
HOOK_ORDER = {"param": 0, "factory": 1, "forward_pre": 2, "forward": 3, "grad": 4}


@dataclass(frozen=True)
class RawEntry:
    """One statement's effect on one tensor along one mesh dimension."""

    module: str  # owning module path ("" = root)
    hook: str  # "param" | "factory" | "forward_pre" | "forward"
    tensor: str  # parameter/buffer name, "<in>", "<out>" or "<factory>"
    key: int | str | None  # input/output key (int position or str name); None for parameters
    mesh_dim: int
    placement: Placement
    phase: Optional[Phase]  # parameters only: INIT / RUN
    statement: Statement
    # plan.redistribute: the placement on this mesh dim it arrives in, and its gradient's
    # placements on arrival (grad_src) and on leaving backwards (grad_dst); None = not stated.
    source: Optional[Placement] = None
    grad_src: Optional[Placement] = None
    grad_dst: Optional[Placement] = None

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
    key: int | str | None
    action: str  # "distribute" | "gather" | "redist" | "factory" | "annotate"
    targets: Targets
    # gather: the INIT placements it gathers from; redist: the placements plan.redistribute says
    # the tensor arrives in (None: not stated)
    sources: Targets | None = None
    statements: tuple[int, ...] = ()
    mesh_dim_names: tuple[str, ...] = field(default=(), repr=False)
    # redist: the gradient's placements on arrival (moved there first) and on leaving; None: DTensor's
    grad_sources: Targets | None = None
    grad_targets: Targets | None = None

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
            arrow = "" if self.action in ("distribute", "annotate") else "->"
            src = self._fmt(self.sources) if self.sources and self.action == "redist" else ""
            body = f"{self.action}({src}{arrow}{self._fmt(self.targets)})"
        if self.grad_sources or self.grad_targets:
            body += f":grad({self._fmt(self.grad_sources) if self.grad_sources else ''}->{self._fmt(self.grad_targets) if self.grad_targets else ''})"
        return f"{where}:{self.tensor}:{key}:{body}"


@dataclass
class PlanIR:
    """The lowered plan: raw entries as lowered, and the optimised entries hooks are made from."""

    raw: list[RawEntry]
    entries: list[Entry]
    mesh_dim_names: tuple[str, ...]
    mesh_dim_sizes: tuple[int, ...] = ()  # set by lowering; empty when unknown

    def hooks(self) -> dict[tuple[str, str], list[Entry]]:
        """Entries grouped per (module, hook); each group becomes one installed hook. "param"
        entries are not hooks: parallelize applies them once."""
        grouped: dict[tuple[str, str], list[Entry]] = {}
        for e in self.entries:
            if e.hook != "param":
                grouped.setdefault((e.module, e.hook), []).append(e)
        return grouped

    def coverage(self) -> dict[str, dict]:
        """Per mesh dim: ``replicated`` (parameters/buffers the plan leaves Replicate on it in both
        phases), ``sharded`` (those sharded on it in some phase) and ``activations`` (activation and
        factory entries that place something on it, Replicate included)."""
        out: dict[str, dict[str, list]] = {n: {"replicated": [], "sharded": [], "activations": []} for n in self.mesh_dim_names}
        placed: dict[str, set] = {}
        for e in self.entries:
            name = f"{e.module}.{e.tensor}" if e.module else e.tensor
            if e.action == "annotate":  # says how a tensor is laid out; places nothing
                continue
            if e.hook == "param" or e.action == "gather":
                for d, p in zip(self.mesh_dim_names, e.targets):
                    if not isinstance(p, Replicate):
                        placed.setdefault(d, set()).add(name)
            else:
                for d, p in zip(self.mesh_dim_names, e.targets):
                    if p is not None:
                        out[d]["activations"].append(str(e))
        for e in self.entries:
            if e.hook == "param":
                name = f"{e.module}.{e.tensor}" if e.module else e.tensor
                for d in self.mesh_dim_names:
                    out[d]["sharded" if name in placed.get(d, ()) else "replicated"].append(name)
        return out

    def idle_mesh_dims(self) -> list[str]:
        """Mesh dims of size > 1 on which the plan shards no parameter and places no activation
        other than Replicate: every rank along them would do the same work (a silent no-op)."""
        idle = []
        for i, (d, c) in enumerate(self.coverage().items()):
            size = self.mesh_dim_sizes[i] if self.mesh_dim_sizes else 2
            if size > 1 and not c["sharded"] and not self._shards_activation_on(i):
                idle.append(d)
        return idle

    def _shards_activation_on(self, i: int) -> bool:
        """Whether an activation is split on mesh dim i: moved there (a shard / redistribute), or
        annotated as split there (a per-rank batch share at the root, say: each rank its own rows)."""
        return any(
            e.hook not in ("param", "grad") and e.action != "gather" and e.targets[i] is not None and not isinstance(e.targets[i], Replicate)
            for e in self.entries
        )

    def report(self) -> str:
        """Per mesh dim: the parameters left replicated and whether any activation is placed."""
        lines = []
        for d, c in self.coverage().items():
            rep, total = c["replicated"], len(c["replicated"]) + len(c["sharded"])
            names = ", ".join(rep[:6]) + (f", ... (+{len(rep) - 6} more)" if len(rep) > 6 else "")
            acts = f"{len(c['activations'])} activation(s) placed" if c["activations"] else "no activation placed"
            lines.append(f"# {d}: {len(rep)} of {total} parameters replicated{': ' + names if rep else ''}; {acts}")
        idle = self.idle_mesh_dims()
        if idle:
            lines.append(f"# WARNING: the plan does nothing on mesh dim(s) {idle} (parallelize(..., strict=True) refuses it)")
        return "\n".join(lines)

    def __str__(self) -> str:
        head = (
            f"# Plan IR: {len(self.raw)} raw entries -> {len(self.entries)} entries in "
            f"{len(self.hooks())} hooks; mesh dims {self.mesh_dim_names}"
        )
        return "\n".join([head] + [str(e) for e in self.entries] + [self.report()])

    __repr__ = __str__


def _fuse(group: list[RawEntry], ndim: int, what: str, attr: str = "placement") -> tuple[Targets, tuple[int, ...]]:
    """Merge per-dim raw entries into one target per mesh dim (their ``attr``: the placement, or a
    redistribute's source / gradient placements; entries that do not state it are skipped),
    rejecting conflicts."""
    chosen: list[Optional[RawEntry]] = [None] * ndim
    for e in group:
        if getattr(e, attr) is None:
            continue
        prev = chosen[e.mesh_dim]
        if prev is None:
            chosen[e.mesh_dim] = e
        elif getattr(prev, attr) != getattr(e, attr):
            label = "placements" if attr == "placement" else attr.replace("_", " ") + " placements"
            raise PlanError(
                f"conflicting {label} for {what}: {prev.statement} asks for "
                f"{placement_str(getattr(prev, attr))} but {e.statement} asks for "
                f"{placement_str(getattr(e, attr))}; keep one of them (or narrow one path)"
            )
        # else: a duplicate of an earlier statement, dropped
    targets = tuple(getattr(c, attr) if c else None for c in chosen)
    stmts = tuple(sorted({e.statement.index for e in group}))
    return targets, stmts


def _stated(group: list[RawEntry], ndim: int, what: str, attr: str) -> Targets | None:
    """A redistribute's fused source / gradient placements, or None if no statement gives them."""
    if all(getattr(e, attr) is None for e in group):
        return None
    return _fuse(group, ndim, what, attr)[0]


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
        else:  # an annotation says how a tensor arrives; a shard / redistribute moves it
            acts.setdefault((e.module, e.hook, e.tensor, e.key, e.statement.kind == "annotate"), []).append(e)

    entries: list[Entry] = []
    for name, group in params.items():
        entries += _param_entries(name, group, ndim, mesh_dim_names)
    for (module, hook, tensor, key, annotation), group in acts.items():
        what = f"{tensor}[{key}] of module {module or '<root>'!r}" if key is not None else f"{tensor} of module {module or '<root>'!r}"
        if hook == "grad":
            what = f"the gradient of {module + '.' if module else ''}{tensor}"
        targets, stmts = _fuse(group, ndim, what)
        action = "annotate" if annotation else "factory" if hook == "factory" else "redist"
        extras = [_stated(group, ndim, what, a) for a in ("source", "grad_src", "grad_dst")]
        entries.append(Entry(module, hook, tensor, key, action, targets, extras[0], stmts, mesh_dim_names, *extras[1:]))

    return PlanIR(raw=list(raw), entries=ordered(entries, module_order), mesh_dim_names=mesh_dim_names)


def ordered(entries: list[Entry], module_order: dict[str, int]) -> list[Entry]:
    """Entries in module order, then hook order. Stable: within a hook, parameters keep
    named_parameters() order and activations plan order; annotations first (they describe a
    tensor as it arrives, before the plan moves it)."""
    return sorted(entries, key=lambda e: (module_order.get(e.module, -1), HOOK_ORDER[e.hook], e.action != "annotate"))
