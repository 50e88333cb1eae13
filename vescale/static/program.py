"""Static Eager's program: what each module's hooks do in one record's static steps, decided once.

The recording (``record.py``) notes what crossed every module boundary; the runtime
(``runtime.py``) executes static steps. Between the two, this module decides, from a complete
``Record`` and the plan's facts held by the runtime (which modules the plan keeps eager, where it
places or annotates tensors, the root's hooks, batch-local scopes), the record's *program*:

* ``decide``: per module, a frozen ``Steps``: whether its body runs on local tensors, and what its
  hooks do at its boundary (wrap local tensors as the recorded DTensors, unwrap, run precompiled
  moves, or nothing). Decided for every module when the record's first static step begins and kept
  as a read-only mapping, ``Record.program``; a derived record's moves settle their sizes at their
  first call (``resize.LazyMove``).
* ``find_relabelled``: the batch-local modules whose hooks precompiled relabels replace (relabel.py).
* ``find_quiet``: the modules whose hooks have nothing to do at all, found once the first static
  step has checked the record (that step runs every module's hooks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Mapping

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate
from vescale._torch import DTensorSpec, hooks_beyond

from . import averaged, relabel, resize
from .boundary import Move, dtensor_of, grad_spec, local_of
from .local_calls import local_call_paths
from .local_ops import LocalLookups
from .record import Crossing, Record

if TYPE_CHECKING:
    from .runtime import StaticRuntime

__all__ = ["Steps", "runs_static", "decide", "find_relabelled", "find_quiet", "wrapper", "unwrapper", "compile_moves"]


@dataclass(frozen=True)
class Steps:
    """What one module's hooks do in the static steps of one record: its part of the record's
    program, never changed once decided; ``grad_specs`` and ``shadows`` are caches filled per
    parameter (``StaticRuntime._local_parameters``)."""

    static: bool  # its body runs on local tensors
    parent_static: bool  # its caller's body does
    wrap_in: bool  # enter: local inputs become the recorded DTensors
    wrap_out: bool  # leave: local outputs do
    moves_in: Callable | None  # enter: ``fn(index, tensor)`` running the precompiled moves, if any
    moves_out: Callable | None  # leave: the same for outputs
    placed_in: bool = False  # enter: local inputs are as a plan.annotate states: the plan's hook leaves them be
    placed_out: bool = False  # leave: the same for outputs
    grad_specs: dict = field(default_factory=dict)  # parameter name -> spec of its gradient
    shadows: dict = field(default_factory=dict)  # parameter name -> its last ParamShadow
    lookups: LocalLookups | None = None  # entered while its body runs: its masked lookups (local_ops.py)
    # The root only (see _root_moves): the user's plain inputs straight to the local tensors the
    # plan places them as, and the body's local outputs to the DTensors the user gets.
    root_in: Callable | None = None
    root_out: Callable | None = None


def runs_static(rt: StaticRuntime, rec: Record, path: str | None) -> bool:
    """Whether ``path``'s body runs on local tensors in ``rec``'s static steps (what
    ``StaticRuntime.is_static`` answers in them): not kept eager by the plan nor by the recording."""
    return path is not None and path not in rt.forced_eager and path not in rec.unsafe


def _parent_static(rt: StaticRuntime, rec: Record, path: str) -> bool:
    return runs_static(rt, rec, rt.parent.get(path))


def decide(rt: StaticRuntime, rec: Record) -> Mapping[str, Steps]:
    """Every module's ``Steps`` in ``rec``'s static steps, decided once, before the first one runs.
    A derived record keeps its source's for the quiet modules it took over (resize.py): nothing
    crosses their boundaries, and their parameter caches stay valid."""
    carried = rec.resized_from.program if rec.resized_from is not None else None
    quiet = rec.quiet or {}
    return MappingProxyType({path: carried[path] if carried is not None and path in quiet else _decide_steps(rt, rec, path)
                             for path in rt.modules})


def _decide_steps(rt: StaticRuntime, rec: Record, path: str) -> Steps:
    """What ``path``'s hooks do in ``rec``'s static steps (the same facts the recording mirrored:
    which modules run static, and where the plan places tensors)."""
    static, parent_static = runs_static(rt, rec, path), _parent_static(rt, rec, path)
    wrap_in = parent_static and (path in rt.planned_pre or not static)
    wrap_out = static and (path in rt.planned_post or not parent_static)
    # Between two static modules a planned redistribution runs as precompiled moves where every
    # tensor there has one; otherwise the local tensors are wrapped and DTensor moves them.
    moves_in = _moves(rec, path, "in", "body") if wrap_in and static else None
    moves_out = _moves(rec, path, "out", "result") if wrap_out and parent_static else None
    placed_in = static and parent_static and not wrap_in and path in rt.annotated_pre
    placed_out = static and parent_static and not wrap_out and path in rt.annotated_post
    lookups = rec.lookups.get(path) if static else None
    root_in, root_out = _root_moves(rt, rec) if path == "" and static else (None, None)
    return Steps(static, parent_static, wrap_in, wrap_out, _mover(moves_in), _mover(moves_out), placed_in, placed_out,
                 lookups=LocalLookups(lookups) if lookups else None, root_in=root_in, root_out=root_out)


def _root_moves(rt: StaticRuntime, rec: Record) -> tuple:
    """The root's boundary as precompiled moves, where the plan's root statements only move data.

    In eager mode the user's plain inputs become Replicate DTensors that the plan's hook
    redistributes (a batch split over DP), and the root's hooks redistribute a Partial loss to
    Replicate, all through DTensor's planner: ~0.15 ms a tensor and step. Recorded, each is a move
    between two known layouts: the inputs' from Replicate (what a plain tensor is) to the body's,
    the outputs' from the body's to what the user got (then wrapped as that DTensor). Not for a
    root whose inputs a plan.annotate describes (already local shards), whose statements state
    gradient layouts, or that runs batch-local; (None, None) then."""
    if rt.root_hooks is None or "" in rt.annotated_pre or "" in rt.annotated_post:
        return None, None
    if any(spot[0] == "" for spot in rt.grad_dst_spots):
        return None, None
    crossings = rec.crossings
    root_in: list = []
    while ("", "in", len(root_in)) in crossings:
        i = len(root_in)
        src, dst = crossings["", "in", i], crossings.get(("", "body", i))
        if dst is None or src.spec is not None:  # a DTensor input: the general path
            return None, None
        root_in.append(None if dst.spec is None else _FromGlobal(dst))
    out_moves = compile_moves(crossings, "", "out", "result")
    if out_moves is None:
        return None, None
    wrap = wrapper(crossings, "", "result")
    return _mover(root_in), lambda i, t: wrap(i, out_moves[i](t) if out_moves[i] is not None else t)


def find_relabelled(rt: StaticRuntime, rec: Record) -> frozenset:
    """The batch-local modules whose hooks ``rec``'s static steps replace by precompiled relabels
    (relabel.py): static, with a static caller and everything inside static, every tensor at their
    boundary relabelled. Their moves go into ``rec.moves`` now, before ``decide`` (in a derived
    record, moves compiled at their first call, once the sizes settle)."""
    found = set()
    for path, scope in rt.scopes.items():
        inside = [p for p, s in rt.scope_of.items() if s == path]
        if not _parent_static(rt, rec, path) or not all(runs_static(rt, rec, p) and p not in rec.lookups for p in inside):
            continue
        if any(spot[0] in inside for spot in rt.grad_dst_spots):
            continue
        moves = [compile_moves(rec.crossings, path, src, dst, (scope, side))
                 for src, dst, side in (("in", "body", "in"), ("out", "result", "out"))]
        if None not in moves:
            rec.moves[(path, "in")], rec.moves[(path, "out")] = moves
            found.add(path)
    return frozenset(found)


def find_quiet(rt: StaticRuntime, rec: Record) -> dict:
    """The modules of ``rec`` whose hooks have nothing to do in its static steps: run in the
    recording, static with a static caller, no tensor wrapped, moved or placed at their boundary, no
    random op to replay, no hooks but the runtime's (the plan's run inside them), and leaf
    parameters (ZeRO-3's gathered ones come from hooks). Also the members of ZeRO-3 units whose only
    other hooks are the plan's gathers: their unit's module gathers for them (``rec.quiet_units``,
    see ``StaticRuntime.unit_in``)."""
    quiet: dict = {}
    units: dict = {}
    local_calls = {p for p in local_call_paths(rec.losses, rec.sizes) if runs_static(rt, rec, p)}  # the mode runs only there
    for path, hooks in rt.own_hooks.items():
        mod = hooks.module
        inner = hooks.inner.ids  # the hooks that ran before Static Eager's came (the plan's)
        scope = rt.scope_of.get(path)
        if scope in (rec.relabelled or ()):  # its parameter views are bypassed in these steps
            inner = inner - rt.scopes[scope].param_hooks.get(path, frozenset())
        steps = rec.program[path]
        if not path or (path, "in") not in rec.keys or not steps.static or not steps.parent_static or path in rec.random:
            continue
        if steps.lookups is not None:
            continue  # its hooks open the masked lookups' mode around its body (local_ops.py)
        if path in local_calls or rt.parent.get(path) in local_calls:
            # Its hooks (or its callees' hooks) turn the local calls' mode on and off around its
            # body: without them the mode would stay on through everything the body calls.
            continue
        if steps.wrap_in or steps.wrap_out or steps.placed_in or steps.placed_out:
            continue
        if hooks_beyond(mod, hooks.ids):
            continue  # the user's hooks, added since, work here
        member = rt.units.member(rec, path, inner) if inner else None
        if inner and member is None:
            continue  # the plan's hooks work here
        if all(not isinstance(p, DTensor) or (isinstance(p, nn.Parameter) and p.grad_fn is None) for p in mod._parameters.values()):
            quiet[path] = mod
            if member is not None:
                units.setdefault(member[0], []).append((path, mod, member[1]))
    rec.quiet_units = units
    return quiet


# ---------------------------------------------------------------------------------------------
# The program's pieces: wraps, unwraps and precompiled moves at one boundary
# ---------------------------------------------------------------------------------------------


def _mover(moves: list | None):
    """``fn(index, tensor)`` applying the i-th precompiled move (None: a tensor passing through)."""
    if moves is None:
        return None
    return lambda i, t: moves[i](t) if i < len(moves) and moves[i] is not None else t


def wrapper(crossings: dict, path: str, where: str) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """``fn(index, tensor)``: a local tensor crossing ``(path, where)`` as the DTensor recorded there."""
    return lambda i, t: _wrap(t, crossings.get((path, where, i)))


def unwrapper(crossings: dict, path: str, where: str) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """``fn(index, tensor)``: a DTensor crossing ``(path, where)`` as its local tensor."""
    return lambda i, t: _unwrap(t, crossings.get((path, where, i)))


def _wrap(t: torch.Tensor, c: Crossing | None):
    """A local tensor standing for the DTensor recorded at this spot, as that DTensor."""
    if c is None or c.spec is None or isinstance(t, DTensor):
        return t
    if c.pending is not None:  # a derived record's first step: the sizes follow this tensor
        resize.settle(c, t)
    if c.wrap_grad is None:
        c.wrap_grad = grad_spec(c.spec, c.leave_grad)
        c.wrap_divisor = averaged.wrap_divisor(c.spec)
    if c.wrap_divisor != 1:  # an averaged Partial: each rank's local value has 1/n of the gradient
        t = averaged.divide_grad(t, c.wrap_divisor)
    return dtensor_of(t, c.spec, c.wrap_grad)


def _unwrap(t: torch.Tensor, c: Crossing | None):
    """A DTensor's local tensor; its gradient leaves here in the placements recorded for this spot."""
    if not isinstance(t, DTensor):
        return t
    if c is None:
        return t.to_local()
    if c.pending is not None:  # a derived record's first step: this DTensor must be as derived
        resize.settle(c, t)
    if c.unwrap_grad is None:
        c.unwrap_grad = grad_spec(t._spec, c.grad_placements)
    return local_of(t, c.unwrap_grad)


def _moves(rec: Record, path: str, src: str, dst: str) -> list | None:
    """The precompiled moves from ``(path, src)`` to ``(path, dst)``, compiled once per record."""
    key = (path, src)
    if key not in rec.moves:
        rec.moves[key] = compile_moves(rec.crossings, path, src, dst)
    return rec.moves[key]


def compile_moves(crossings: dict, path: str, src: str, dst: str, relabelled: tuple | None = None) -> list | None:
    """One ``Move`` (or None: a plain tensor passing through) per tensor recorded at ``(path, src)``,
    or None if some tensor there cannot move as local tensors (a plain tensor the plan places).
    ``relabelled``: ``(scope, side)`` of a batch-local module's boundary (relabel.py)."""
    def make(a: Crossing, b: Crossing) -> Move:
        return Move(a.spec, b.spec, b.grad_placements, a.leave_grad)

    moves: list = []
    while (path, src, len(moves)) in crossings:
        i = len(moves)
        a, b = crossings[(path, src, i)], crossings.get((path, dst, i))
        if b is None:
            return None
        if relabelled is not None:
            scope, side = relabelled
            move = relabel.relabelled_move(a, b, scope, side, make)
            if move is False:
                return None
            moves.append(move)
            continue
        if a.spec is None and b.spec is None:
            moves.append(None)
        elif a.spec is None or b.spec is None or a.spec.mesh != b.spec.mesh or a.spec.shape != b.spec.shape:
            return None
        elif averaged.averaged_dims(a.spec) or averaged.averaged_dims(b.spec):
            return None  # wrapped instead: the wrap divides its gradient (vescale.static.averaged)
        elif a.pending is not None or b.pending is not None:  # sizes settle at the first call
            moves.append(resize.LazyMove(a, b, make))
        else:
            moves.append(make(a, b))
    return moves


class _FromGlobal:
    """A plain root input (the global tensor, the same on every rank) to this rank's local tensor
    laid out as recorded at ``dst``: the move from Replicate, compiled at the first call (a derived
    record's sizes settle from the tensor's global shape)."""

    def __init__(self, dst: Crossing):
        self.dst = dst
        self.move: Move | None = None

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.move is None:
            dst = self.dst
            if dst.pending is not None:
                dst.spec, dst.pending = dst.pending.settle_global(tuple(t.shape)), None
            whole = DTensorSpec(dst.spec.mesh, (Replicate(),) * dst.spec.mesh.ndim, tensor_meta=dst.spec.tensor_meta)
            self.move = Move(whole, dst.spec, dst.grad_placements)
        return self.move(t)
