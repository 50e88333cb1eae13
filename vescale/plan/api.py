"""The Plan API: a short, model-independent description of how to shard which tensor, and when.

A plan is a list of statements. Each names tensors by a full-match regular expression over *tensor
paths* — the module path from ``named_modules()`` plus a tensor name — and says how they are placed
on a device mesh:

    plan = VescalePlan()
    plan.shard(r"layers\\.\\d+\\.attn\\.q_proj\\.weight", Shard(0), mesh="TP")    # a parameter
    plan.shard(r"layers\\.\\d+\\.<in>", Shard(1), mesh="TP")                      # a forward input
    plan.shard(r".*weight", Shard(0), mesh="DP", phase=INIT)                    # ZeRO-3 at rest ...
    plan.shard(r".*weight", Replicate(), mesh="DP", phase=RUN)                  # ... gathered to run
    plan.factory(r"model\\.rotary_emb", Replicate())                            # tensors made in forward
    plan.redistribute(r"layers\\.\\d+\\.mlp\\.<in>", Shard(1), Replicate(), mesh="TP")  # a checked move
    plan.annotate(r"norm\\.weight\\.grad", Partial(), mesh="TP")                    # what a gradient is

Tensor names: a parameter or buffer name, ``<in>`` (first forward input), ``<in>[i]`` (positional
input i), ``<in>[name]`` (input by argument name, positional or keyword), ``<out>`` (the output, or
its first element), ``<out>[i]`` / ``<out>[name]`` (an element of a tuple / dict-like output).
A non-numeric key is a full-match regular expression like the rest of the path
(``<in>[(input_ids|labels)]``); a key that matches nothing at a module's first call is an error.

The plan holds no model and no mesh: ``vescale.plan.lower`` resolves it against both.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Sequence, Union

from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from vescale._torch import _StridedShard

__all__ = ["Phase", "INIT", "RUN", "Statement", "VescalePlan", "placement_str"]


class Phase(enum.Enum):
    """When a parameter placement applies: INIT is how it is stored between steps, RUN how forward
    and backward need it. A statement without a phase applies to both."""

    INIT = "INIT"
    RUN = "RUN"

    def __repr__(self) -> str:
        return self.value


INIT, RUN = Phase.INIT, Phase.RUN

PlacementArg = Union[Placement, Sequence[Placement]]

# `<in>`, `<in>[3]`, `<out>[logits]` (brackets escaped or not) ending a path: its activation token.
_ACTIVATION = re.compile(r"<(in|out)>(?:\\?\[(.+?)\\?\])?$")
_ACTIVATION_KINDS = ("shard", "redistribute", "annotate")
_GRAD_SUFFIXES = (r"\.grad", ".grad")  # a parameter's gradient: `<parameter path>.grad`


@dataclass(frozen=True)
class Statement:
    """One call on a plan, kept verbatim so errors can quote it."""

    kind: str  # "shard", "factory", "eager", "experts", "batch_local", "redistribute" or "annotate"
    path: str
    placements: tuple[Placement, ...]
    mesh_dim: str | None
    phase: Phase | None
    index: int  # position in the plan, for messages and stable ordering
    # plan.redistribute only: the placements the tensor must arrive in, and those of its gradient
    # on arrival (grad_src) and on leaving backwards (grad_dst); () = not given.
    source: tuple[Placement, ...] = ()
    grad_src: tuple[Placement, ...] = ()
    grad_dst: tuple[Placement, ...] = ()

    @property
    def activation(self) -> tuple[str, str | None] | None:
        """("in" | "out", key or None) when the path names a forward input/output, else None."""
        m = _ACTIVATION.search(self.path)
        return (m.group(1), m.group(2)) if m else None

    @property
    def grad_of(self) -> str | None:
        """plan.annotate on ``<parameter path>.grad``: the parameter path regex, else None."""
        if self.kind == "annotate" and self.path.endswith(_GRAD_SUFFIXES):
            return self.path[: -len(next(x for x in _GRAD_SUFFIXES if self.path.endswith(x)))]
        return None

    @property
    def module_pattern(self) -> str:
        """For factory statements: the regex over module paths. For activation statements: the
        regex over activation paths ``<module>.<in>`` / ``<in>`` (root), the key left out — the
        path is still one full-match regex, so ``.*\\.<in>`` does not match the root's ``<in>``."""
        m = _ACTIVATION.search(self.path) if self.kind in _ACTIVATION_KINDS else None
        return self.path[: m.start()] + re.escape(f"<{m.group(1)}>") if m else self.path

    def __str__(self) -> str:
        where = f", mesh={self.mesh_dim!r}" if self.mesh_dim else ""
        when = f", phase={self.phase.value}" if self.phase else ""
        def fmt(ps: Sequence[Placement]) -> Sequence[Placement] | str:
            return ps and (placement_str(ps[0]) if len(ps) == 1 else "[" + ", ".join(map(placement_str, ps)) + "]")

        if self.source:  # src, dst: one placement or a list each
            what = f", {fmt(self.source)}, {fmt(self.placements)}"
        elif self.kind == "batch_local":
            what = ""
        else:
            what = "".join(", " + placement_str(p) for p in self.placements)
        grads = "".join(f", {k}={fmt(v)}" for k, v in (("grad_src", self.grad_src), ("grad_dst", self.grad_dst)) if v)
        return f"#{self.index} plan.{self.kind}({self.path!r}{what}{grads}{where}{when})"


def placement_str(p: Placement) -> str:
    """Short form used in IR dumps: R, S(0), P(sum), IS(0,3)."""
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    if isinstance(p, _StridedShard):  # vescale.InterleavedShard (or DTensor's equal _StridedShard)
        return f"IS({p.dim},{p._split_factor_int()})"
    return repr(p)


def _as_placements(placement: PlacementArg, path: str) -> tuple[Placement, ...]:
    if isinstance(placement, Placement):
        items = (placement,)
    elif isinstance(placement, (list, tuple)):
        items = tuple(placement)
    else:
        items = ()
    if not items or not all(isinstance(p, Placement) for p in items):
        raise TypeError(
            f"plan path {path!r}: placement must be a Shard/Replicate/Partial/InterleavedShard or a list of them "
            f"(one per mesh dimension), got {placement!r}"
        )
    return items


class VescalePlan:
    """An ordered list of sharding statements; see the module docstring for the path syntax."""

    def __init__(self) -> None:
        self.statements: list[Statement] = []

    def shard(
        self,
        path: str,
        placement: PlacementArg,
        mesh: str | None = None,
        phase: Phase | None = None,
    ) -> "VescalePlan":
        """Place the tensors matching ``path``.

        ``placement`` is one placement applied on mesh dimension ``mesh`` (the other dimensions
        stay Replicate), or a list with one placement per mesh dimension (``mesh`` omitted).
        ``phase`` (INIT or RUN) applies to parameters only; omitted means both.
        """
        if phase is not None and not isinstance(phase, Phase):
            raise TypeError(f"plan path {path!r}: phase must be vescale.INIT or vescale.RUN, got {phase!r}")
        self._add("shard", path, placement, mesh, phase)
        return self

    def factory(self, path: str, placement: PlacementArg, mesh: str | None = None) -> "VescalePlan":
        """Tensors created by factory functions (torch.zeros, arange, ...) inside the forward of the
        modules matching ``path`` (a module path; ``""`` is the root) become DTensors with this
        placement. Unplanned factory tensors stay plain and meet DTensors as Replicate."""
        self._add("factory", path, placement, mesh, None)
        return self

    def redistribute(
        self,
        path: str,
        src: PlacementArg,
        dst: PlacementArg,
        grad_src: PlacementArg | None = None,
        grad_dst: PlacementArg | None = None,
        mesh: str | None = None,
    ) -> "VescalePlan":
        """Move the activation ``path`` (``<module>.<in>[key]`` / ``<module>.<out>[key]``) from
        ``src`` to ``dst`` placements: ``plan.shard`` of an activation with its source stated, so a
        tensor that arrives laid out otherwise is an error naming this statement, not a different
        collective. (A plain tensor arrives as Replicate: it is the global tensor.)

        Backward by default moves the gradient the way DTensor does (to ``src`` with Partial as
        Replicate). ``grad_src`` says how the gradient must arrive (it is moved there first if it
        arrives otherwise) and ``grad_dst`` how it leaves, e.g. ``grad_dst=Partial()`` to leave a
        gradient unreduced for a later fused reduction.

        In ``mode="static"`` the move runs on local tensors as one precompiled collective; this is
        the statement ``vescale.static.export_plan`` prints for each move it recorded.
        """
        grads = {name: _as_placements(v, path) for name, v in (("grad_src", grad_src), ("grad_dst", grad_dst)) if v is not None}
        self._add("redistribute", path, dst, mesh, None, source=_as_placements(src, path), **grads)
        return self

    def annotate(self, path: str, placement: PlacementArg, mesh: str | None = None) -> "VescalePlan":
        """State how a tensor is laid out, without moving it.

        * ``<module>.<in>[key]`` / ``<out>[key]``: the activation there is a DTensor with these
          placements (an error naming this statement if not). A plain tensor there is taken as this
          rank's *local shard* with these placements (``DTensor.from_local``, even shards): that is
          how code that makes local tensors tells vescale, and random ops such as dropout inside the
          module, which global elements it holds. On the root's inputs it is the per-rank batch:
          ``plan.annotate("<in>[(input_ids|labels)]", Shard(0), mesh="DP")`` has each DP rank pass
          only its rows (``vescale.data`` loads them) where ``plan.shard`` would split a global
          batch every rank passes whole; the results are the same.
        * ``<parameter path>.grad``: the gradient the model computes for the parameter (before
          vescale reduces it) has these placements, e.g. ``Partial()`` on TP for a norm weight
          under sequence parallelism. Checked at the first backward (and against what Static Eager
          recorded), so a plan that assumes a reduction the model does not need is an error.
        """
        self._add("annotate", path, placement, mesh, None)
        return self

    def eager(self, path: str) -> "VescalePlan":
        """Keep the modules matching ``path`` (a module path regex; ``""`` is the root) on DTensors in
        ``parallelize(..., mode="static")``: their own ops run eagerly, their children may still run
        static. For modules whose code cannot run on local shards (a ``view`` with a global head
        count, say); static mode finds most such modules by itself. No effect in eager mode."""
        if not isinstance(path, str):
            raise TypeError(f"plan.eager: path must be a regular expression string, got {path!r}")
        try:
            re.compile(path)
        except re.error as e:
            raise ValueError(f"plan.eager: path {path!r} is not a valid regular expression: {e}") from None
        st = Statement("eager", path, (), None, None, len(self.statements))
        self.statements.append(st)
        return self

    def experts(self, path: str, mesh: str = "EP") -> "VescalePlan":
        """Expert parallelism for the MoE experts modules matching ``path`` (a module path regex): their
        parameters are split by expert (``Shard(0)``) over mesh dim ``mesh``, and their tokens are
        routed to the rank holding their expert and back with all-to-all around the module's
        unchanged forward (``vescale.parallel.experts``, which says what an experts module is)."""
        self.shard(rf"(?:{path})\.[^.]+", Shard(0), mesh=mesh)
        self._add("experts", path, Shard(0), mesh, None)
        return self

    def batch_local(self, path: str, mesh: str = "DP") -> "VescalePlan":
        """The modules matching ``path`` (a module path regex) compute on this rank's share of the batch
        along mesh dim ``mesh`` only, as on one device per ``mesh`` rank: per-token modules (an MoE
        block's router and experts), whose data-dependent ops DTensor would otherwise run on every
        rank's tokens. While such a module runs, its inputs (``Shard(0)`` on ``mesh``: split by batch;
        or replicated there) and its parameters (replicated there; ZeRO-3 gathers them for the RUN
        phase) are DTensors on the sub-mesh of the other dims, so their other placements (TP) work
        as before; parameter gradients leave as ``Partial`` over ``mesh`` (vescale's DP / ZeRO-3
        reduction sums them) and outputs go back ``Shard(0)`` on ``mesh``. Random ops inside are
        refused (they would not draw the single-device numbers). ``vescale.parallel.batch_local``
        says more; works in eager and static mode."""
        self._add("batch_local", path, Replicate(), mesh, None)
        return self

    def _add(self, kind, path, placement, mesh, phase, **extra) -> Statement:
        """Check and append one statement; ``extra``: a redistribute's source / gradient placements."""
        if not isinstance(path, str) or not (path or kind == "factory"):
            raise TypeError(f"plan.{kind}: path must be a non-empty regular expression string, got {path!r}")
        try:
            re.compile(path)
        except re.error as e:
            raise ValueError(f"plan.{kind}: path {path!r} is not a valid regular expression: {e}") from None
        if mesh is not None and not isinstance(mesh, str):
            raise TypeError(f"plan path {path!r}: mesh must name a mesh dimension (a string), got {mesh!r}")
        placements = _as_placements(placement, path)
        if mesh is not None and len(placements) != 1:
            raise ValueError(
                f"plan path {path!r}: with mesh={mesh!r} give one placement, not {len(placements)}; "
                "omit mesh to give one placement per mesh dimension"
            )
        st = Statement(kind, path, placements, mesh, phase, len(self.statements), **extra)
        if kind == "shard" and st.activation and phase is not None:
            raise ValueError(f"{st}: phase applies to parameters and buffers, not to activations")
        if kind == "redistribute" and st.activation is None:
            raise ValueError(f"{st}: redistribute names an activation, <module>.<in>[key] or <module>.<out>[key]")
        if kind == "annotate" and st.activation is None and st.grad_of is None:
            raise ValueError(
                f"{st}: annotate names an activation (<module>.<in>[key] / <out>[key]) or a parameter's "
                f"gradient (<parameter path>.grad), not {path!r}"
            )
        for name, value in extra.items():
            if len(value) != len(placements):
                raise ValueError(f"{st}: {name} gives {len(value)} placement(s) but dst gives {len(placements)}")
        self.statements.append(st)
        return st

    def __repr__(self) -> str:
        lines = "\n".join(f"  {s}" for s in self.statements)
        return f"VescalePlan(\n{lines}\n)" if lines else "VescalePlan()"
