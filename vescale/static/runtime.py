"""Static Eager runtime: modules run on plain local tensors; DTensors exist only at module boundaries.

The paper's section 6.2. Eager DTensor pays sharding propagation and wrapping on every op, although
the placements of almost every tensor are the same step after step. In static mode each module is
either *static* (its own forward runs on the local shards, as plain PyTorch) or *eager* (it runs on
DTensors). Tensors change representation only where a module boundary separates the two, or where
the plan redistributes; there a hook turns the local tensor into a DTensor with the placements,
global shape and gradient placements recorded for that exact spot, lets DTensor redistribute, and
takes the local tensor again. Autograd follows: from_local / redistribute / to_local are
differentiable, so backward communicates at the same spots and nowhere else.

Where those recorded facts come from: the first training step with a given set of root input
shapes runs fully eager and *records* (``RECORD``), for every module boundary, the DTensor spec of
each tensor crossing it before and after the plan's hooks, the placements its gradient arrives in,
and the placements of every parameter's gradient. A ``TorchDispatchMode`` watches every DTensor op of
that step and asks DTensor's own sharding propagation whether the op would redistribute its inputs
or draw random numbers; a module that runs such an op itself (not in a child) stays eager, and
``plan.eager(path)`` keeps a module eager by hand. One such op is recorded instead: a
vocabulary-parallel lookup into the module's own table, which static steps run masked on the local
rows (``local_ops.py``). Ops whose size arguments DTensor rewrites to local
sizes (view, reshape, expand, new_zeros, ...) are fine when the model derives sizes from its tensors;
their local shapes are recorded and the first static step checks them. A ``view`` / ``reshape`` the
model gives a global size (one from its config) gets the local size in static steps instead
(``local_sizes.py``). Once that step's backward
has finished, later steps with the same input shapes run ``STATIC``. New input shapes that differ
from a recorded record's only in sizes (a new sequence length) derive their record from it instead
of recording (``resize.py``: sizes left open, settled by the first step's tensors); other new
shapes, and those it refuses, record again.

Every static step computes what the eager step computes: the same local ops on the same local
values, and the same DTensor operations at the same boundaries.

Record -> program -> executor: ``record.py`` notes the recording step, ``program.py`` decides from a
complete record what each module's hooks do in its static steps (once, before the first), and this
module runs the steps: which state a step is in, and the hooks' work on each module call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import re
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from vescale._torch import TorchDispatchMode, enter_dispatch_mode_beneath, exit_dispatch_mode, hooks_beyond
from torch.utils.weak import WeakIdKeyDictionary

from ..dispatch.local import decisions_remembered
from ..parallel.hooks import _register_once_on_grads, call_state, _tensors_in
from ..plan.ir import PlanError
from ..parallel.placing import grad_layout
from ..placement.blocks import local_shape_and_offset
from . import averaged, program, relabel, resize
from .boundary import HandOvers, ParamShadow, dtensor_of, grad_spec, local_of, settled_on_unit_dims
from .random_gate import CallTracker, RandomGate
from .record import Crossing, Record, _OpWatcher, input_keys, output_keys
from .recompute import RegionState, in_backward, refuse_outside_region, unnoted_region
from .quiet import QuietModules
from .units import Units
from .program import Steps

if TYPE_CHECKING:
    from ..plan.api import Statement
    from .install import ModuleHooks
from .shares import GradientShares
from .local_calls import CallWatch, LocalCalls, drop_plain_sizes, local_call_paths
from .local_ops import grad_placements, unmasked_inputs

__all__ = ["StaticRuntime", "State"]


class State(enum.Enum):
    RECORD = "record"  # this step runs eagerly and records
    STATIC = "static"  # this step runs on local tensors


# ---------------------------------------------------------------------------------------------
# Walking a module's inputs and outputs
# ---------------------------------------------------------------------------------------------


def _map_io(fn, args: tuple, kwargs: dict):
    """Apply ``fn(index, tensor)`` to every tensor among args then kwargs, in call order."""
    from ..parallel.hooks import _map_tensors

    counter = iter(range(1 << 30))
    new_args = _map_tensors(lambda t: fn(next(counter), t), list(args))
    new_kwargs = {k: _map_tensors(lambda t: fn(next(counter), t), v) for k, v in kwargs.items()}
    return tuple(new_args), new_kwargs


def _map_out(fn, output):
    from ..parallel.hooks import _map_tensors

    counter = iter(range(1 << 30))
    return _map_tensors(lambda t: fn(next(counter), t), output)


def _any_dtensor(obj) -> bool:
    """Whether a DTensor sits anywhere in ``obj`` (what ``_map_io`` / ``_map_out`` walk): a scan that
    builds nothing, so a static step walks (and rebuilds) a module's inputs or outputs only where
    there is something to unwrap."""
    if isinstance(obj, torch.Tensor):
        return isinstance(obj, DTensor)
    if isinstance(obj, (tuple, list)):
        for item in obj:
            if _any_dtensor(item):
                return True
        return False
    if isinstance(obj, dict):
        for item in obj.values():
            if _any_dtensor(item):
                return True
        return False
    # Dataclasses (model outputs) are rare at inner boundaries: let the walk look.
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


class _RandomReplay(TorchDispatchMode):
    """Active in static steps of a model whose static modules draw random numbers: the k-th random
    op of a module's body gets its tensors back as the DTensors recorded for it (same placements and
    global shape), so vescale.random draws exactly the single-device numbers for this shard; every
    other op passes straight through. Once the record knows which torch functions draw
    (``random_gate.py``), the mode is on around those calls only."""

    def __init__(self, record: Record, stack: list):
        super().__init__()
        self.record, self.stack = record, stack
        self.random_ops = DTensor._op_dispatcher._random_ops
        self.drawn: dict[str, int] = {}
        self.on = False
        funcs = record.random_funcs
        self.tracker = CallTracker() if funcs is None else None  # this step learns them
        self.gate = RandomGate(funcs, self._switch) if funcs else None

    def turn(self, on: bool) -> None:
        """On while the body of a module that draws runs: the gate, or the dispatch mode itself."""
        if self.gate is not None:
            self.gate.switch(on)
            return
        if self.tracker is not None:
            self.tracker.switch(on)
        self._switch(on)

    def finish(self) -> None:
        """End of a forward that ran to the end: keep what this step learnt; in a gated step, check
        that every module drew what it drew when recorded (a call the gate let through unreplayed
        would have drawn fewer)."""
        rec = self.record
        complete = all(self.drawn.get(m, 0) == len(specs) for m, specs in rec.random.items())
        if self.tracker is not None and complete:
            rec.random_funcs = frozenset() if self.tracker.untracked else frozenset(self.tracker.drawing)
        elif self.gate is not None and not complete:
            module = next(m for m, specs in rec.random.items() if self.drawn.get(m, 0) != len(specs))
            raise PlanError(
                f"module {module!r} drew {self.drawn.get(module, 0)} times in a static step but "
                f"{len(rec.random[module])} times when recorded (through {sorted(map(_name, self.gate.funcs))}): "
                f"its random calls changed; keep it on DTensors with plan.eager({module!r})"
            )

    def _switch(self, on: bool) -> None:
        """Enter (on) or leave the dispatch mode stack."""
        if on == self.on:
            return
        self.on = on
        if on:
            self.__enter__()
        else:
            exit_dispatch_mode(self)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        module = self.stack[-1] if self.stack else None
        if func not in self.random_ops or module is None or any(issubclass(t, DTensor) for t in types):
            return func(*args, **kwargs)
        if self.tracker is not None:
            self.tracker.note_draw()
        recorded = self.record.random.get(module, [])
        k = self.drawn[module] = self.drawn.get(module, 0) + 1
        if k > len(recorded):
            raise PlanError(
                f"module {module!r} drew more random numbers in a static step than when it was recorded; "
                f"keep it on DTensors with plan.eager({module!r})"
            )
        specs = recorded[k - 1]

        def as_recorded(j: int, a: Any) -> Any:
            spec = resize.replay_spec(specs, j, a) if isinstance(a, torch.Tensor) else None
            return DTensor(a, spec, requires_grad=False) if spec is not None else a

        tensors = iter(range(len(specs)))  # the specs were recorded for the tensor arguments, in order
        out = func(*[as_recorded(next(tensors), a) if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
        if isinstance(out, (tuple, list)):
            return type(out)(o._local_tensor if isinstance(o, DTensor) else o for o in out)
        return out._local_tensor if isinstance(out, DTensor) else out


# ---------------------------------------------------------------------------------------------
# The runtime
# ---------------------------------------------------------------------------------------------


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or str(func)


def _mirror(t, leave_grad: tuple | None = None):
    """While recording: what static mode's wrap does to the gradient at this spot, applied to an
    eager DTensor: the gradient leaves in ``leave_grad`` (a plan.redistribute's grad_dst), or by
    DTensor's default for from_local (laid out like the forward value)."""
    if not isinstance(t, DTensor):
        return t
    if leave_grad is not None:
        return dtensor_of(t.to_local(grad_placements=leave_grad), t._spec, grad_spec(t._spec, leave_grad))
    return DTensor.from_local(t.to_local(), t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


def _to_local_node(node):
    """The ``to_local`` node under a mirrored wrap's ``from_local`` (where its gradient leaves), or
    None."""
    for _ in range(3):
        if node is None or node.name() == "_ToTorchTensorBackward":
            return node
        node = next((n for n, _ in node.next_functions if n is not None), None)
    return None


class StaticRuntime:
    """Static Eager state of one parallelised model (``state_of(model).static``)."""

    def __init__(
        self,
        model: nn.Module,
        eager_paths: set[str],
        planned_pre: set[str],
        planned_post: set[str],
        annotated: tuple[set[str], ...] = (set(), set()),
        grad_dst_spots: dict | None = None,
        batch_local: dict | None = None,
    ):
        self.model = model
        # Module path -> its caller's path ("" is the root, whose caller is the user: None): the
        # nearest ancestor that runs forward. A container (ModuleList) is never called, so the
        # module whose forward loops over it is the one that meets its children's outputs.
        self.parent = _callers(model)
        self.modules = dict(model.named_modules(remove_duplicate=False))
        self.forced_eager = set(eager_paths)
        # Modules a recording found summing gradients of different layouts (_OpWatcher._mixed_sum),
        # or handing one over in a layout no local tensor holds (_unlaid_gradients): the cause shows
        # only while they are assumed static, so every later record starts with them.
        self.mixed_sums: dict[str, str] = {}
        self.planned_pre, self.planned_post = planned_pre, planned_post
        # Modules whose inputs / outputs a plan.annotate describes: between two static modules the
        # local tensors there are laid out as annotated already (checked while recording).
        self.annotated_pre, self.annotated_post = annotated
        # (module, "in" | "out", key) -> a plan.redistribute's grad_dst there (None per unstated dim)
        self.grad_dst_spots = dict(grad_dst_spots or {})
        self.records: dict[tuple, Record] = {}
        self.state: State | None = None
        self.record: Record | None = None
        self.stack: list[str] = []
        self.watcher: _OpWatcher | None = None
        self.remembered: contextlib.AbstractContextManager | None = None  # a recording's decisions_remembered() context, open with its watcher
        self.replay: _RandomReplay | None = None
        self.call_watch: CallWatch | None = None  # a recording forward's (local_calls.py)
        self.local_calls: LocalCalls | None = None  # a static forward's, with calls to run locally
        self.static_steps = self.recorded_steps = 0
        # New input sizes derive their record from a recorded one where only sizes differ (resize.py);
        # False: every new key records (tests compare the two bit for bit).
        self.reuse_records = True
        # Records kept, least recently used dropped first (each holds specs, moves and hook decisions
        # for one set of input shapes).
        self.max_records = 64
        self.last_refusal: str | None = None  # why the last new key could not derive its record
        self.verifying: Record | None = None  # the record whose first static step runs now
        self.refused: set = set()  # keys whose derived record failed its first step: they record
        # Parameter -> {id(gradient spec): ParamShadow}; weak, so a dropped parameter takes its shadows along.
        self.shadows = WeakIdKeyDictionary()
        self.own_hooks: dict[str, ModuleHooks] = {}  # each module's Static Eager hooks (install.py)
        self.hookless = QuietModules()  # what silencing this step's quiet modules changed (quiet.py)
        # A user option (docs/static.md): False gives every use of a parameter its own autograd node
        # (``local_of``), so that ``torch.autograd.grad(loss, params)`` reaches the parameters.
        self.param_leaves = True
        self.hand_overs = HandOvers()  # shadows' hand-overs that wait for the end of backward
        # The root's inputs and outputs as precompiled moves (see program._root_moves); None: never. The
        # ids of every hook parallelize put on the root (install_static sets them): a hook added
        # since may expect the plan's DTensors, so the moves run only while there is none.
        self.root_hooks: frozenset | None = None
        self.units = Units()  # ZeRO-3 units that gather for their members (units.py; install_static finds them)
        # Batch-local modules (path -> vescale.parallel.batch_local.Scope), and the scope of every
        # module at or inside one; see relabel.py.
        self.scopes = dict(batch_local or {})
        self.scope_of = {inner: path for path, scope in self.scopes.items() for inner, _ in scope.module.named_modules(prefix=path)}
        # Activation checkpointing (recompute.py): whether a root forward runs now, the checkpointed
        # regions whose forward runs now, the region being recomputed, and what its recomputation
        # put aside (restored at its end).
        self.in_forward = False
        # (module, swapped) of the static bodies running now whose inside() swapped their parameters
        self.live_swaps: list = []
        self.recomputations = 0  # checkpointed regions recomputed in static steps' backward
        self.regions: list[RegionState] = []
        self.recompute: RegionState | None = None
        self._aside: list = []

    # -- which representation each module uses in the current step ---------------------------

    def is_static(self, path: str) -> bool:
        """Whether ``path`` runs static in this step; while recording, whether the recording runs it
        as if it will (the boundaries static mode converts at are mirrored, so that eager's backward
        sees gradients laid out as static mode will hand them over)."""
        if self.record is None:
            return False
        if self.state is State.RECORD:
            return path not in self.forced_eager and path not in self.record.assumed_eager
        return program.runs_static(self, self.record, path)

    def parent_static(self, path: str) -> bool:
        parent = self.parent.get(path)
        return parent is not None and self.is_static(parent)

    # -- root ---------------------------------------------------------------------------------

    def begin_step(self, args: tuple, kwargs: dict) -> None:
        """Root pre-hook: pick this step's state from the root inputs' shapes."""
        if in_backward():
            raise PlanError(
                "the root module runs its forward during backward (activation checkpointing around the whole "
                "model): Static Eager mode recomputes regions inside a step; checkpoint the model's layers instead"
            )
        self.regions.clear()  # left over only by a forward that raised inside a region
        self.live_swaps.clear()
        self.in_forward = True
        self.hand_overs.discard()  # left over only by a backward that failed before its end
        self._begin(args, kwargs)
        relabelled = self.record.relabelled if self.state is State.STATIC else None
        for path, scope in self.scopes.items():
            scope.bypass = bool(relabelled) and path in relabelled
        # Hooks come off the modules with nothing to do in this step, back on every other module.
        quiet = self._quiet_now()
        self.hookless.silence(quiet, self.own_hooks)
        self.units.begin(self.record, quiet)
        self.hookless.swap_at_root(quiet, self.units.quiet_members(),  # their unit swaps theirs
                                self._record_locals)

    def _begin(self, args, kwargs) -> None:
        # The modules' training flags are part of the key: a record made in evaluation mode saw no
        # dropout draw, and a training step run static from it would draw on local shards as if
        # they were whole tensors (nothing replays them).
        key = (tuple((tuple(t.shape), t.dtype) for t in _tensors(args, kwargs)),
               tuple(m.training for m in self.modules.values()))
        if self.watcher is not None:  # the last recording's (closed only here), or one whose forward raised
            self._close_watcher()
        self._close_replay()
        self._close_calls()
        self.hookless.restore_at_root(_put_back)  # left over only if the last forward's cleanup did not run
        if self.verifying is not None:  # the same: its first step did not run through
            self._verified(False)
        if not torch.is_grad_enabled():
            # An evaluation forward: runs eagerly, records nothing, keeps the training records.
            self.state, self.record = None, None
            return
        rec = self.records.get(key)
        if rec is not None:
            self.records[key] = self.records.pop(key)  # the most recently used last (see _bound_records)
        elif self.reuse_records:
            rec = self._derive(key)
        if rec is not None and rec.complete and not set(rec.unsafe) <= rec.assumed_eager:
            # It found modules that must be eager: record again, running those eagerly, until the
            # set is stable (the boundaries, and so the gradients' layouts, depend on it).
            rec = self.records[key] = self._new_record(key, frozenset(rec.assumed_eager | set(rec.unsafe)))
            return
        if rec is not None and rec.complete:
            self.state, self.record = State.STATIC, rec
            self.static_steps += 1
            if rec.relabelled is None:
                # (A derived record finds its source's: the same recorded specs and eager modules,
                # so the quiet modules it took over stay quiet.)
                rec.relabelled = self._find_relabelled(rec)
            if rec.program is None:  # after the relabels: their moves are the modules' moves
                rec.program = self._decide_program(rec)
            if rec.random:
                # Entered only while the body of a module that draws runs (see _follow_body).
                self.replay = _RandomReplay(rec, self.stack)
            local = {p for p in local_call_paths(rec.losses, rec.sizes) if self.is_static(p)}
            if local:  # on only while those modules' own bodies run (see _follow_body)
                self.local_calls = LocalCalls({p: k for p, k in rec.losses.items() if p in local},
                                              {p: r for p, r in rec.sizes.items() if p in local},
                                              self.own_ops_off, sites=rec.size_sites, derived=rec.resized_from is not None,
                                              scale=resize.checked_before(rec))
            if not rec.checked:
                rec.checked = True
                self.verifying = rec
                if not resize.checked_before(rec):  # see resize.py: a derived record checks at its crossings
                    self._open_watcher(checking=True)
            elif rec.quiet is None:
                rec.quiet = program.find_quiet(self, rec)
            return
        # A new set of shapes: start from the modules the last recording found eager (the same
        # model code decides them, whatever the sizes), so one recording step usually suffices.
        last = self.latest()
        self._new_record(key, frozenset(last.assumed_eager | set(last.unsafe)) if last is not None else frozenset())

    def _derive(self, key) -> Record | None:
        """A record for ``key`` derived from the latest complete recorded one that differs from it in
        sizes only (``resize.py``), or None (the step records)."""
        if key in self.refused:
            return None
        for old_key, old in reversed(list(self.records.items())):
            if old.resized_from is not None or not old.complete or not set(old.unsafe) <= old.assumed_eager:
                continue
            factors = resize.size_factors(old_key, key)
            if factors is None:
                continue
            rec, self.last_refusal = resize.derive(old, factors, Record, Crossing)
            if rec is not None:
                self.records[key] = rec
                self._bound_records(rec)
            return rec
        self.last_refusal = "no recorded record differs from these inputs in sizes only"
        return None

    @property
    def resized_records(self) -> int:
        """Derived records kept (``resize.py``)."""
        return sum(r.resized_from is not None for r in self.records.values())

    def _verified(self, ok: bool) -> None:
        """The end of a record's first static forward: ``ok`` if it ran through. A derived record whose
        first step failed is forgotten, and its key records next time."""
        rec, self.verifying = self.verifying, None
        if ok:
            rec.verified = True
            drop_plain_sizes(rec.sizes)  # and those whose notes the first static step dropped
            if rec.resized_from is not None:
                resize.finish(rec)
        elif rec.resized_from is not None:
            self._forget(rec)

    def _bound_records(self, keep: Record) -> None:
        """Drop the least recently used records beyond ``max_records``: a run over many sequence
        lengths would otherwise keep one record (specs, moves, hook decisions) per length. Never
        ``keep`` (the one this step runs), nor the last recorded one a new length can derive from."""
        while len(self.records) > self.max_records:
            # A recorded one may go if ``keep`` is recorded itself or another recorded one stays.
            sources = sum(r.resized_from is None and r is not keep for r in self.records.values())
            victim = next((k for k, r in self.records.items() if r is not keep and (
                r.resized_from is not None or keep.resized_from is None or sources > 1)), None)
            if victim is None:
                return
            del self.records[victim]

    def _forget(self, rec: Record) -> None:
        """Drop the derived record ``rec``: its key records next time."""
        for key in [k for k, r in self.records.items() if r is rec]:
            del self.records[key]
            self.refused.add(key)

    def _new_record(self, key, assumed_eager: frozenset) -> Record:
        self.state, self.record = State.RECORD, Record(assumed_eager=assumed_eager, shares=GradientShares())
        self.record.unsafe.update(self.mixed_sums)
        self.records[key] = self.record
        self.recorded_steps += 1
        self._bound_records(self.record)
        self._open_watcher(checking=False)
        rec = self.record
        self.watcher.shares = rec.shares
        self.call_watch = CallWatch(lambda: self.stack[-1] if self.stack else None, rec.losses, rec.sizes, self.own_ops_off,
                                    sites=rec.size_sites)
        self.call_watch.__enter__()
        return rec

    def _open_watcher(self, checking: bool) -> None:
        self.watcher = _OpWatcher(self.record, self.stack, checking, self.modules, self.mixed_sums)
        if not checking:  # it asks DTensor's decision for every op: remembered, not searched again
            self.remembered = decisions_remembered()
            self.remembered.__enter__()
        # A recording's watcher outlives this forward (it watches backward too, and is closed at the
        # next root forward), so it goes beneath the modes the user has open: a user's mode entered
        # around the step (vescale.debug.CollectiveCounter, say) exits first and must pop itself.
        enter_dispatch_mode_beneath(self.watcher)

    def end_forward(self, error: BaseException | None = None) -> None:
        """The root's clean-up: the forward is over (``error``: what it raised). A recording keeps
        watching through backward (closed when backward finishes, or at the next step); a check is
        done."""
        self.in_forward = False
        self.regions.clear()
        if self.state is State.RECORD and self.watcher is not None and not self.watcher.checking:
            self.watcher.forget_plain_bodies()
        if self.watcher is not None and (self.state is State.STATIC or not torch.is_grad_enabled()):
            self._close_watcher()
        replay = self.replay
        self._close_replay()
        self._close_calls()
        self.hookless.restore_at_root(_put_back)
        ok = error is None
        if isinstance(error, resize.ResizeMismatch) and self.record is not None and self.record.resized_from is not None:
            self._forget(self.record)  # a spot its first step did not reach (verifying is over)
        try:
            if replay is not None and ok:
                replay.finish()
        except BaseException:
            ok = False
            raise
        finally:
            if self.verifying is not None:
                self._verified(ok)

    def _close_replay(self) -> None:
        if self.replay is not None:
            replay, self.replay = self.replay, None
            replay.turn(False)
            replay._switch(False)
            self.stack.clear()

    def _close_calls(self) -> None:
        if self.call_watch is not None:
            self.call_watch.close()
            self.call_watch = None
        if self.local_calls is not None:
            self.local_calls.turn(None)
            self.local_calls = None

    @contextlib.contextmanager
    def own_ops_off(self) -> Iterator[None]:
        """A local kernel's ops (and, while recording, the DTensor ops of the call it stands for)
        are not the running module's own: the op watcher neither judges nor shape-checks them."""
        if not (self.watcher is not None and self.stack):
            yield
            return
        # Only the watcher hears of it: the modes that follow bodies stay as they are (this may run
        # inside one of their handlers, where switching them would push them twice).
        running, self.stack[-1] = self.stack[-1], None
        self.watcher.body_changed()
        try:
            yield
        finally:
            self.stack[-1] = running
            self.watcher.body_changed()

    def _close_watcher(self) -> None:
        if self.remembered is not None:
            remembered, self.remembered = self.remembered, None
            remembered.__exit__(None, None, None)
        watcher, self.watcher = self.watcher, None
        exit_dispatch_mode(watcher)
        self.stack.clear()

    def _when_backward_done(self, record: Record) -> None:
        # Only mark the record here. The watcher is closed on the user's thread (next root
        # forward): autograd runs this callback under the thread-local state captured when
        # backward() was called and restores the caller's state afterwards, so popping the mode
        # here would leave it on the caller's dispatch stack, watching every later op.
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._complete(record))

    def _complete(self, record: Record) -> None:
        bodies, callers = record.shares.settle(self.parent) if record.shares is not None else ({}, {})
        record.shares = None
        for found in (bodies, callers):
            for path, why in found.items():
                record.unsafe.setdefault(path, why)
        # A caller's mixed sums show only while it is assumed static: every later record starts with it.
        self.mixed_sums.update({p: why for p, why in callers.items() if p not in self.mixed_sums})
        unlaid = self._unlaid_gradients(record)
        record.unsafe.update(unlaid)
        self.mixed_sums.update(unlaid)
        # Modules that would get an eager module's unmasked masked-Partial stay eager (local_ops.py),
        # counting those this recording found eager (they will be next time), to a fixed point.
        while True:
            eager = set(record.assumed_eager) | self.forced_eager | set(record.unsafe)
            found = {p: why for p, why in unmasked_inputs(record.masked, self.parent, eager).items() if p not in record.unsafe}
            if not found:
                break
            record.unsafe.update(found)
        drop_plain_sizes(record.sizes)
        record.complete = True

    def _unlaid_gradients(self, record: Record) -> dict:
        """Static bodies that would hand a gradient over in a layout their local tensor cannot have.

        Autograd gives a tensor's gradient the tensor's own shape. A static body's gradient for its
        input (``body``) or for a child's output (``result``) is a local tensor of the forward
        tensor's local shape, handed over as the placements DTensor's backward gave it while
        recording. Where those split the tensor otherwise (DTensor's backward of a ``sum`` over a
        sharded activation expands its gradient replicated, where local autograd expands it to the
        local shard), no local tensor is that gradient: the body that makes it stays eager (path ->
        why). Not a body that only passes on such a gradient it got for its own output: once the
        maker is eager, the boundary there hands it over laid out (the recording mirrors it)."""
        eager = set(record.assumed_eager) | self.forced_eager | set(record.unsafe)
        unlaid = {key for key, c in record.crossings.items() if key[1] in ("body", "result") and not _laid(c)}
        found = {}
        for path, where, i in sorted(unlaid):
            maker = path if where == "body" else self.parent.get(path)
            if maker is None or maker in eager or maker in found or any(k[0] == maker and k[1] == "result" for k in unlaid):
                continue
            c = record.crossings[(path, where, i)]
            tensor = f"its input {i}" if where == "body" else f"output {i} of {path!r}"
            found[maker] = (f"in backward, the gradient of {tensor} is {list(c.grad_placements)} on DTensors, which a "
                            f"local tensor laid out as {list(c.spec.placements)} cannot hold")
        return found

    # -- per-module hooks ----------------------------------------------------------------------
    #
    # In a static step every hook first takes the module's ``Steps`` (the record's program,
    # decided once, when its first static step begins) and returns at once where it has nothing to
    # do: most modules of a static step neither wrap, move nor unwrap anything, and their hooks
    # should cost a dict lookup, not a walk over their inputs and outputs.

    def enter(self, mod: nn.Module, path: str, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Before the plan's pre-hook: local inputs become the DTensors they stand for, if the plan
        redistributes them here or this module runs eagerly."""
        if self.recompute is None and self.state is not None and in_backward():
            refuse_outside_region(path)  # a forward inside backward with no region noted (recompute.py)
        for region in self.regions:  # a checkpointed region's forward runs: its modules (recompute.py)
            region.entered.add(path)
        if self._tracking():
            self.stack.append(None)  # this module's hooks run now, not its body
            self._follow_body()
        if self.state is State.STATIC:
            steps = self._steps(path)
            if steps.root_in is not None and self._root_hooks_ours(mod):
                # The plan's hook leaves the inputs alone; inside() moves them, once every other
                # root pre-hook (the input contract) has seen the global tensors.
                call_state(mod).io_placed = True
                return None
            if steps.moves_in is not None:
                call_state(mod).io_placed = True  # the plan's hook leaves the placed tensors alone
                return _map_io(steps.moves_in, args, kwargs)
            if steps.wrap_in:
                return _map_io(program.wrapper(self.record.crossings, path, "in"), args, kwargs)
            if steps.placed_in:
                call_state(mod).io_placed = True
            return None
        wraps = self.parent_static(path) and (path in self.planned_pre or not self.is_static(path))
        if self.state is State.RECORD:
            self.record.keys.setdefault((path, "in"), input_keys(mod, args, kwargs))
            if not self.regions and unnoted_region():
                refuse_outside_region(path, recomputed=False)
            if path in self.units.unit_of and self.recompute is None:
                self.units.note_call(self.record, path, self.stack)
        return self._to_dtensors(path, "in", wraps, lambda fn: _map_io(fn, args, kwargs))

    def inside(self, mod: nn.Module, path: str, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """After the plan's pre-hook: a static module gets local inputs and local parameters."""
        if self.state is State.RECORD:
            return self._inside_recording(mod, path, args, kwargs)
        if self.state is not State.STATIC or not self._steps(path).static:
            self._body_starts(path)
            return None
        steps = self.record.program[path]
        moved = None
        # Unless enter() handed over local tensors already, unwrap whatever arrives as a DTensor
        # (from an eager caller, or placed by the plan's hook).
        placed = call_state(mod).take_io_placed()
        if placed and steps.root_in is not None:  # the root's plain inputs, left alone by the plan's hook
            moved = _map_io(steps.root_in, args, kwargs)
        elif not placed and (_any_dtensor(args) or _any_dtensor(kwargs)):
            moved = _map_io(program.unwrapper(self.record.crossings, path, "body"), args, kwargs)
        swapped = self._local_parameters(mod, path, steps)
        if swapped:
            call_state(mod).swapped = swapped
            self.live_swaps.append((mod, swapped))  # a region starting in its body finds them (recompute.py)
        if steps.lookups is not None:
            steps.lookups.enter(mod)
        self._body_starts(path)
        return moved

    def _inside_recording(self, mod, path: str, args, kwargs):
        rec = self.record
        if self.recompute is not None:  # the recorded forward again: noted already
            self._body_starts(path)
            return None

        def note(i: int, t: torch.Tensor) -> torch.Tensor:
            c = rec.note(self.parent, (path, "body", i), t)
            if c.spec is not None and self.watcher is not None:
                self.watcher.dtensor_bodies.add(path)
            if averaged.averaged_dims(c.spec):  # its body would get a share of an averaged value
                rec.unsafe.setdefault(path, f"its input is {averaged.describe(c.spec)} (averaged over ranks)")
            if isinstance(t, DTensor) and t.requires_grad and torch.is_grad_enabled():
                # The gradient this body's own ops hand back for it (a tensor several modules
                # consume, as q/k/v projections share their input, collects all their gradients,
                # but a static module's local tensor gets its own share only): read off autograd's
                # nodes, with no node added (vescale/static/shares.py).
                uses.append(rec.shares.expect(t, path, f"input {i}", True, lambda g, c=c: setattr(c, "grad_placements", g)))
            return t

        uses: list = []
        args, kwargs = _map_io(note, args, kwargs)
        # The gradient placements of each parameter as the module produces them: before
        # vescale.comm reduces them on the leaf.
        if self.watcher is not None and any(isinstance(p, DTensor) for p in mod._parameters.values()):
            self.watcher.dtensor_bodies.add(path)
        for name, p in mod._parameters.items():
            if isinstance(p, DTensor) and p.requires_grad and torch.is_grad_enabled():
                key = (path, name)
                uses.append(rec.shares.expect(p, path, f"parameter {name!r}", False,
                                              lambda g, key=key: rec.param_grads.__setitem__(key, g)))
        if uses:
            call_state(mod).shares = uses
        self._body_starts(path)
        return args, kwargs

    def _local_parameters(self, mod, path: str, steps: Steps) -> list:
        """Swap a static module's DTensor parameters (and planned buffers) for their local tensors,
        for this call; returns what ``restore`` puts back."""
        swapped = []
        params = mod._parameters
        for name, p in params.items():
            if isinstance(p, DTensor):
                spec = steps.grad_specs.get(name)
                if spec is None:
                    spec = steps.grad_specs[name] = self._param_grad_spec(path, name, p)
                local = None
                if self.param_leaves and p.requires_grad and p.grad_fn is None and torch.is_grad_enabled():
                    local = self._shadow(steps, name, p, spec)
                if local is None:
                    local = local_of(p, spec)
                params[name] = local
                swapped.append((name, p, local))
        for name, b in mod._buffers.items():
            if isinstance(b, DTensor):  # planned buffers: their local shard, no gradient
                mod._buffers[name] = b._local_tensor
                swapped.append((name, b, b._local_tensor))
        return swapped

    def _record_locals(self, mod: nn.Module, path: str) -> list:
        """``_local_parameters`` with the steps this step's record decided for ``path``."""
        return self._local_parameters(mod, path, self.record.program[path])

    def _shadow(self, steps: Steps, name: str, p: DTensor, spec) -> torch.Tensor:
        """The plain leaf standing for the leaf parameter ``p`` (see ``ParamShadow``). One per
        parameter and gradient layout, shared by every module that uses it (autograd sums their
        gradients before the parameter's hooks run, as it does for the parameter: a tied ZeRO-3
        weight's two modules hand over one gradient, reduced once); uses with different gradient
        layouts hand their gradients over separately, as ``local_of`` would. Modules record their
        gradient specs apart, so equal specs are found by value."""
        shadow = steps.shadows.get(name)  # the last call's: the same parameter, outside ZeRO-3
        if shadow is None or shadow.param_ref() is not p or shadow.spec is not spec or not shadow.fits(p):
            per_spec = self.shadows.get(p)
            if per_spec is None:
                per_spec = self.shadows[p] = {}
            shadow = per_spec.get(spec)
            if shadow is None or shadow.spec != spec or not shadow.fits(p):
                shadow = per_spec[spec] = ParamShadow(p, spec, self.hand_overs)
            if isinstance(p, nn.Parameter):  # not ZeRO-3's gathered copies: new each call, freed after
                steps.shadows[name] = shadow
        return shadow.leaf

    def _param_grad_spec(self, path: str, name: str, p: DTensor):
        rec = self.record
        spec = rec.param_grad_specs.get((path, name))
        if spec is None:
            placements = grad_placements(rec.lookups, path, name, p, rec.param_grads.get((path, name)))
            scope = self.scope_of.get(path)
            if scope is not None and scope in (rec.relabelled or ()):  # recorded on the sub-mesh
                placements = relabel.grad_placements(placements, p, self.scopes[scope])
            spec = grad_spec(p._spec, settled_on_unit_dims(placements, p._spec))
            # One object per layout: modules that use one parameter (tied embeddings) with equal
            # gradient layouts then share its shadow (``_shadow``), whose leaf sums their gradients
            # before the one hand-over, as autograd sums them before the parameter's AccumulateGrad.
            # (Two shadows handed over two gradients: the first one's reduction hooks ran before the
            # second was added, a few ulps off eager mode.)
            spec = rec.param_grad_specs[(path, name)] = rec.shared_grad_specs.setdefault(spec, spec)
        return spec

    def _body_starts(self, path: str) -> None:
        if self._tracking() and self.stack:
            self.stack[-1] = path
            self._follow_body()

    def _follow_body(self) -> None:
        """The random replay intercepts ops only while the body of a module that draws random
        numbers runs: as a dispatch mode it costs every op it sees a Python call, and most of a
        step's ops belong to modules that draw nothing."""
        if self.replay is not None:
            self.replay.turn(bool(self.stack) and self.stack[-1] in self.record.random)
        if self.local_calls is not None:
            self.local_calls.turn(self.stack[-1] if self.stack else None)
        if self.watcher is not None and self.recompute is None:
            self.watcher.body_changed()

    def _tracking(self) -> bool:
        return self.watcher is not None or self.replay is not None or self.local_calls is not None

    def restore(self, mod: nn.Module, path: str) -> None:
        """Always called after forward: the module gets its own parameters back."""
        call = call_state(mod)
        call.io_placed = False  # set only if forward raised between leave and handed_back
        uses, call.shares = call.shares, None
        if uses:
            GradientShares.end(uses)
        swapped, call.swapped = call.swapped, None
        if swapped:
            _put_back(mod, swapped)
            live = self.live_swaps
            for i in range(len(live) - 1, -1, -1):
                if live[i][1] is swapped:
                    del live[i]
                    break
        if self.state is State.STATIC:
            steps = self.record.program.get(path)
            if steps is not None and steps.lookups is not None and steps.lookups.module is mod:
                steps.lookups.exit()
        if self._tracking() and self.stack:
            self.stack.pop()
            self._follow_body()

    def leave(self, mod: nn.Module, path: str, output: Any) -> Any:
        """Before the plan's post-hook: local outputs of a static module become DTensors if the plan
        redistributes them here or the caller runs eagerly."""
        if self._tracking() and self.stack:
            self.stack[-1] = None  # the body is over
            self._follow_body()
        if self.state is State.STATIC:
            steps = self._steps(path)
            if steps.root_out is not None and self._root_hooks_ours(mod):
                call_state(mod).io_placed = True  # already as the root's hooks would leave them
                return _map_out(steps.root_out, output)
            if steps.moves_out is not None:
                call_state(mod).io_placed = True
                return _map_out(steps.moves_out, output)
            if steps.wrap_out:
                return _map_out(program.wrapper(self.record.crossings, path, "out"), output)
            if steps.placed_out:
                call_state(mod).io_placed = True
            return None
        wraps = self.is_static(path) and (path in self.planned_post or not self.parent_static(path))
        if self.state is State.RECORD:
            self.record.keys.setdefault((path, "out"), output_keys(output))
        return self._to_dtensors(path, "out", wraps, lambda fn: _map_out(fn, output))

    def _root_hooks_ours(self, root: nn.Module) -> bool:
        return not hooks_beyond(root, self.root_hooks)

    def _steps(self, path: str) -> Steps:
        return self.record.program[path]

    # The program's decisions (program.py), as methods a test may replace with a reference path.

    def _decide_program(self, rec: Record) -> Mapping[str, Steps]:
        return program.decide(self, rec)

    def _find_relabelled(self, rec: Record) -> frozenset:
        return program.find_relabelled(self, rec)

    def _to_dtensors(self, path: str, where: str, wraps: bool, walk):
        """While recording, where a local tensor will become a DTensor in static steps (``wraps``):
        record the spec and mirror the wrap's effect on gradients. ``walk(fn)`` applies
        ``fn(index, tensor)`` to the tensors crossing here and returns them."""
        if self.state is State.RECORD and self.recompute is not None:
            # The recorded forward again: the same mirrored wraps, nothing noted.
            crossings = self.record.crossings

            def mirror(i: int, t: torch.Tensor) -> torch.Tensor:
                c = crossings.get((path, where, i))
                return _mirror(t, c.leave_grad if c is not None else None)

            return walk(mirror) if wraps else None
        if self.state is State.RECORD:
            rec = self.record

            keys = rec.keys.get((path, where), [])

            def note(i: int, t: torch.Tensor) -> torch.Tensor:
                c = rec.note(self.parent, (path, where, i), t)
                stated = self.grad_dst_spots.get((path, where, keys[i])) if i < len(keys) else None
                if stated is not None and isinstance(t, DTensor):
                    c.leave_grad = tuple(g or d for g, d in zip(stated, grad_layout(t.placements)))
                why = averaged.wrap_refusal(c.spec, c.leave_grad)
                if why:
                    rec.keep_eager(self.parent, path, why)
                if not wraps:
                    return t
                mirrored = _mirror(t, c.leave_grad)
                if self.watcher is not None and mirrored is not t and mirrored.grad_fn is not None:
                    self.watcher.note_boundary(_to_local_node(mirrored.grad_fn), self.parent.get(path))
                return mirrored

            return walk(note)
        return None

    def handed_back(self, mod: nn.Module, path: str, output: Any) -> Any:
        """After the plan's post-hook: a static caller gets local tensors."""
        if self.state is State.STATIC:
            if not self._steps(path).parent_static:
                return None
            if call_state(mod).take_io_placed():  # leave() already moved them, as local tensors
                return None
            if not _any_dtensor(output):
                return None
            return _map_out(program.unwrapper(self.record.crossings, path, "result"), output)
        if self.state is State.RECORD and self.recompute is None:
            rec = self.record
            is_root = path == ""

            # A static caller gets this output unwrapped (a share of an averaged value would enter
            # its code) unless it stays local: a static module not redistributed here.
            unwrapped = not self.is_static(path) or path in self.planned_post
            caller = self.parent.get(path)

            def note(i: int, t: torch.Tensor) -> torch.Tensor:
                c = rec.note(self.parent, (path, "result", i), t)
                if c.spec is not None and caller is not None and self.watcher is not None:
                    self.watcher.dtensor_bodies.add(caller)  # its body gets a DTensor (and may read its sizes)
                if unwrapped and caller is not None and averaged.averaged_dims(c.spec):
                    rec.unsafe.setdefault(caller, f"gets {averaged.describe(c.spec)} (averaged over ranks) from {path!r}")
                _on_grad(t, lambda g, c=c: setattr(c, "grad_placements", g))
                if is_root and t.requires_grad and t.grad_fn is not None:
                    # The step is recorded once its backward has run to the end.
                    t.grad_fn.register_prehook(lambda grads: self._when_backward_done(rec) or None)
                return t

            _map_out(note, output)
            if is_root:  # the forward is over: find the nodes that hand the bodies their gradients
                rec.shares.hook(_tensors_in(output))
            unit = self.units.unit_of.get(path)
            if unit is not None:
                _register_once_on_grads(output, lambda: unit in rec.unit_reached or rec.units_off.setdefault(
                    unit, f"backward reached {path!r} before the unit's output"))
        return None

    # -- quiet modules (quiet.py) ---------------------------------------------------------------

    def _quiet_now(self) -> dict:
        rec = self.record
        if self.state is not State.STATIC or self.watcher is not None or rec.quiet is None:
            return {}
        return rec.quiet

    # -- activation checkpointing (recompute.py) -----------------------------------------------

    def region_start(self) -> RegionState | None:
        """A checkpointed region's forward starts (``vescale.random.checkpoint_context``): note what
        its recomputation must start from. None outside a training forward of this model."""
        if self.state is None or not (self.in_forward or self.recompute is not None):
            return None
        replay, calls = self.replay, self.local_calls
        # The local parameters of the bodies running now (a region inside a module's body, or inside a
        # ZeRO-3 unit whose module swapped its members'), put in place again for the recomputation.
        swaps = [(mod, [(name, local) for name, _, local in swapped]) for mod, swapped in self.live_swaps]
        swaps += [(mod, [(name, local) for name, _, local in swapped]) for mod, swapped in self.units.swaps()]
        region = RegionState(self, self.state, self.record, list(self.stack),
                             dict(replay.drawn) if replay is not None else {},
                             dict(calls.calls) if calls is not None else {}, swaps)
        self.regions.append(region)
        return region

    def _region_done(self, region: RegionState) -> None:
        if region in self.regions:
            self.regions.remove(region)

    def _begin_recompute(self, region: RegionState) -> None:
        """Around a region's recomputation: the step's state as the region's forward started."""
        self._aside.append((self.state, self.record, self.recompute, list(self.stack), self.replay, self.local_calls,
                            self.watcher.paused if self.watcher is not None else None))
        self.state, self.record, self.recompute = region.state, region.record, region
        self.replay = self.local_calls = None
        self.stack[:] = region.stack
        swapped = []
        if region.state is State.STATIC:
            self.recomputations += 1
            rec = region.record
            if rec.random:
                self.replay = _RandomReplay(rec, self.stack)
                self.replay.drawn = dict(region.drawn)
            local = {p for p in local_call_paths(rec.losses, rec.sizes) if self.is_static(p)}
            if local:
                self.local_calls = LocalCalls({p: k for p, k in rec.losses.items() if p in local},
                                              {p: r for p, r in rec.sizes.items() if p in local},
                                              self.own_ops_off, derived=rec.resized_from is not None,
                                              scale=resize.checked_before(rec))
                self.local_calls.calls = dict(region.calls)
            swapped = self._swap_quiet(region)
            for mod, entries in region.swaps:
                for name, local in entries:
                    store = mod._parameters if name in mod._parameters else mod._buffers
                    swapped.append((store, name, store.get(name)))
                    store[name] = local
        if self.watcher is not None:
            self.watcher.paused = True
        region.swapped = swapped
        if self.stack:
            self._follow_body()

    def _end_recompute(self, region: RegionState) -> None:
        if self.replay is not None:
            self.replay.turn(False)
            self.replay._switch(False)
        if self.local_calls is not None:
            self.local_calls.turn(None)
        for store, name, value in reversed(region.swapped):
            store[name] = value
        region.swapped = []
        state, record, recompute, stack, replay, local_calls, paused = self._aside.pop()
        self.state, self.record, self.recompute, self.replay, self.local_calls = state, record, recompute, replay, local_calls
        self.stack[:] = stack
        if self.watcher is not None and paused is not None:
            self.watcher.paused = paused

    def _swap_quiet(self, region: RegionState) -> list:
        """The quiet modules a region's recomputation may call get their local parameters (their
        hooks are off for the step, and the root put their own back at the end of forward): those
        called by a module whose hooks ran in the region's forward, or by the body that ran it; all
        of them if no hooked module ran in it (a region of quiet modules only)."""
        rec = region.record
        silenced = self.hookless.silenced
        if rec.quiet is None or not silenced:
            return []
        if region.entered:
            callers = rec.quiet_callers
            if callers is None:
                callers = rec.quiet_callers = {}
                for path, mod in rec.quiet.items():
                    caller = self.parent.get(path)
                    while caller in rec.quiet:
                        caller = self.parent.get(caller)
                    callers.setdefault(caller, []).append((path, mod))
            bodies = set(region.entered)
            for path in region.entered:  # and the body each is called from
                caller = self.parent.get(path)
                while caller in rec.quiet:
                    caller = self.parent.get(caller)
                bodies.add(caller)
            quiet = [q for body in bodies for q in callers.get(body, ())]
        else:
            quiet = list(rec.quiet.items())
        members = self.units.quiet_members()  # their unit swaps theirs
        swapped = []
        for path, mod in quiet:
            if path in members or path not in silenced:
                continue
            for name, p, _ in self._local_parameters(mod, path, rec.program[path]):
                swapped.append((mod._parameters if name in mod._parameters else mod._buffers, name, p))
        return swapped

    # -- ZeRO-3 units as one (units.py) -------------------------------------------------------

    def unit_in(self, unit: str) -> None:
        """The unit module's pre-hook: its quiet members get their gathered, local parameters."""
        if self.state is State.STATIC:
            self.units.enter(unit, self._record_locals)

    def unit_out(self, unit: str, output: Any, raised: bool = False) -> None:
        """The unit module's forward hook (always called; ``raised``: forward raised)."""
        if self.state is State.RECORD:
            if self.recompute is None:
                Units.note_reached(self.record, unit, output)
            return
        self.units.exit(unit, output, raised, self.recompute is not None, _put_back)

    # -- reporting -------------------------------------------------------------------------------

    def latest(self) -> Record | None:
        complete = [r for r in self.records.values() if r.complete]
        return complete[-1] if complete else None


def _put_back(mod: nn.Module, swapped: list) -> None:
    """Give ``mod`` back the parameters (and buffers) that ``_local_parameters`` swapped."""
    for name, p, local in swapped:
        store = mod._parameters if name in mod._parameters else mod._buffers
        if store.get(name) is local:
            store[name] = p


def _callers(model: nn.Module) -> dict[str, str | None]:
    from ..plan.lower import runs_forward

    modules = dict(model.named_modules(remove_duplicate=False))
    callers: dict[str, str | None] = {}
    for path in modules:
        caller = path.rpartition(".")[0] if "." in path else ("" if path else None)
        while caller and not runs_forward(modules[caller]):
            caller = caller.rpartition(".")[0] if "." in caller else ""
        callers[path] = caller
    return callers


def _tensors(args, kwargs) -> list[torch.Tensor]:
    found = []
    _map_io(lambda i, t: found.append(t) or t, args, kwargs)
    return found


def _laid(c: Crossing) -> bool:
    """Whether a local tensor laid out as crossing ``c``'s spec has the local shape of its recorded
    gradient (or nothing to compare: a plain tensor, no gradient, the same placements)."""
    spec = c.spec
    if spec is None or c.grad_placements is None or tuple(c.grad_placements) == tuple(spec.placements):
        return True
    local = local_shape_and_offset(spec.shape, spec.mesh, spec.placements, skip_offset=True)[0]
    laid = local_shape_and_offset(spec.shape, spec.mesh, tuple(c.grad_placements), skip_offset=True)[0]
    return tuple(local) == tuple(laid)


def _on_grad(t, fn) -> None:
    """Call ``fn(placements)`` when the DTensor ``t``'s gradient is computed (recording only)."""
    if isinstance(t, DTensor) and t.requires_grad:
        t.register_hook(lambda g: fn(tuple(g.placements)) if isinstance(g, DTensor) else None)


def resolve_eager_paths(statements: Iterable[Statement], model: nn.Module) -> set[str]:
    """Module paths matched by ``plan.eager`` statements (each must match a module that runs)."""
    from ..plan.lower import _closest, runs_forward

    modules = {p: m for p, m in model.named_modules(remove_duplicate=False) if runs_forward(m)}
    found: set[str] = set()
    for st in statements:
        hits = {p for p in modules if re.fullmatch(st.path, p)}
        if not hits:
            raise PlanError(f"{st}: matches no module that runs forward{_closest(st.path, modules)}")
        found |= hits
    return found
