"""ZeRO-3 at run time: gathered parameters (``GatheredParam``) and, in bucketed mode, the
``GatherScheduler`` that gathers a whole unit of parameters with one collective and prefetches the
next unit while the current one computes.

ZeRO-3 memory: a gathered parameter is a DTensor ``W`` with the RUN placements; its storage is freed
(``resize_(0)``; autograd keeps only the storage-less tensor) right after its module's forward, refilled
(into the same storage, through a separate tensor so autograd's version counters are untouched) when
backward reaches the module, and freed again once its gradient is taken. So between uses only the
at-rest shard of each parameter is resident, in forward and in backward.

Units: the parameters of one block, i.e. everything under the same ``<ModuleList>.<index>`` prefix
(``model.layers.3``), and one unit for all parameters outside such lists (embeddings, final norm,
head), like FSDP's per-block wrapping. A unit is gathered when its first module runs, with one
all-gather over the union of its parameters' groups; the next unit (in the order of the previous
forward, or backward) is gathered asynchronously at the same time.

Per-step CPU cost: a unit's gather is planned once (``GatherProgram``: plans, groups, row widths),
and a training forward gathers into the same gathered parameters every step (``GatheredParam.slot``,
as FSDP2 keeps its unsharded parameters): their leaf, gradient hook and spec are made once, the
collective's buffer is copied straight into their storage (one ``split_with_sizes_copy`` per unit),
and that storage is freed between uses exactly as a fresh copy's would be. Backward's refills write
into the freed storage the same way.

Tied (shared) parameters: every module holding the parameter gathers it (lowering gives each use
the gather entry). A unit gathers a parameter once however many of its modules hold it, and those
modules share the gathered copy (kept gathered until the last of them ran), so autograd sums their
gradient contributions into it and it is reduce-scattered once: GPT-2's tied ``wte``/``lm_head``,
both outside the blocks, are gathered once per step. Copies in different units (or a module called
twice) are gathered per use; their gradients wait for each other in the reducer (``more_coming``)
and are reduced once. Per-tensor mode shares one copy per forward (``per_tensor_gather``).

What forward used last stays gathered for backward (FSDP2's rule for its root unit, TorchTitan's
for the last block): a training forward frees a module's gathered parameters only when it gathers
the next unit (``GatherScheduler.release``), so those that forward released after its last new
gather (the last block, the final norm and the head) are still resident when backward, which needs
them first, reaches them. That saves the last block's regather and its collective each step, at
the memory cost FSDP2 pays too: one unit held across the forward/backward boundary, never more
than a running unit and a prefetched one. ``keep_for_backward = False`` frees each one right after
its module's forward.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import re
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from vescale._torch import DTensorSpec, TensorMeta

from ..comm import moves
from ..comm.gather import GatherProgram, GroupGather, gather
from ..comm.grad import _in_dtype, declare_grad_hook
from ..comm.layout import NOTHING
from ..precision import compute_dtype_of, reduce_dtype_of
from ..model_state import WeakStates

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

    from ..comm.grad import GradReducer
    from ..plan.ir import Entry
    from ..precision import MixedPrecision

__all__ = ["GatheredParam", "GatherScheduler", "unit_of", "per_tensor_gather", "next_forward"]

_FORWARDS = itertools.count()  # root forwards so far (any model): a per-tensor copy is shared within one
_forward = [next(_FORWARDS)]


def next_forward() -> None:
    """A root forward begins (``vescale.parallel.hooks.root_hooks``): per-tensor gathered copies of
    earlier forwards are not shared with this one (they may hold values from before an optimiser step)."""
    _forward[0] = next(_FORWARDS)


@dataclasses.dataclass
class ZeroParamState:
    """What ZeRO-3 keeps per parameter (in a weak table, ``zero_state(param)``, not on the parameter)."""

    gathered: list = dataclasses.field(default_factory=list)  # its copies a forward used, waiting for backward
    free_hook: bool = False  # per-tensor mode: the post-accumulate hook that frees those copies is on
    shared_gather: "GatheredParam | None" = None  # per-tensor mode: the copy one forward's uses share
    run_spec: DTensorSpec | None = None  # bucketed mode: the gathered copy's spec, made once


zero_state = WeakStates(ZeroParamState)


class GatheredParam:
    """A parameter gathered to its RUN placements for one forward call of its module.

    ``value`` is the gathered DTensor the module runs with. Without a reducer it is
    ``param.redistribute(RUN)``, autograd-tracked (its backward reduce-scatters per tensor). With a
    reducer (bucketed mode) it is a leaf made from ``local`` (gathered by ``vescale.comm``); its
    gradient is handed to the reducer, which reduce-scatters whole buckets into ``param.grad`` at
    the end of backward.
    """

    def __init__(self, param: DTensor, mesh: DeviceMesh, run_placements, reducer=None, local=None, policy=None):
        self.param, self.mesh, self.run_placements = param, mesh, tuple(run_placements)
        self.state = zero_state(param)
        self.reducer = reducer
        self.forward = _forward[0]  # the root forward it was gathered in (per-tensor sharing)
        # Mixed precision (a vescale.MixedPrecision): gathered in the compute dtype, the shard cast
        # before the collective; its gradient is reduced in the policy's reduce dtype.
        self.policy = policy
        self.dtype = compute_dtype_of(policy, param)
        if reducer is None:
            self.value: DTensor = _redistributed(param, mesh, self.run_placements, self.dtype, reduce_dtype_of(policy, param))
        else:
            if local is None:
                local = gather(param, mesh, self.run_placements, reducer.stats, self.dtype)._local_tensor
            # A leaf DTensor over the gathered local tensor, with the spec made once per parameter
            # (from_local would build and hash a new spec and an autograd node on every call).
            self.value = DTensor(local, _run_spec(self.state, param, mesh, self.run_placements, self.dtype), requires_grad=False)
            if param.requires_grad:
                self.value.requires_grad_(True)
                self.value.register_post_accumulate_grad_hook(self._grad_hook())
        storage = self.value._local_tensor.untyped_storage()
        self.nbytes = storage.nbytes()
        # A gather over mesh dims of size 1 is a no-op that returns the parameter's own storage:
        # that one must never be freed.
        self.owns_storage = storage.data_ptr() != param._local_tensor.untyped_storage().data_ptr()

    @classmethod
    def slot(
        cls, param: DTensor, mesh: DeviceMesh, run_placements: Sequence[Placement], reducer: GradReducer,
        shape: Sequence[int], policy: MixedPrecision | None = None,
    ) -> "GatheredParam":
        """A gathered parameter kept from step to step (bucketed mode): its leaf, hook and spec are
        made once, its storage is allocated only while gathered (``refill_target``) and freed as
        any gathered copy's is, and a static step's plain leaf over it is made once too."""
        local = param._local_tensor.new_empty(shape, dtype=compute_dtype_of(policy, param))
        g = cls(param, mesh, run_placements, reducer, local, policy)
        g.free()
        return g

    @property
    def resident(self) -> bool:
        return self.value._local_tensor.untyped_storage().nbytes() > 0

    def free(self) -> None:
        if self.owns_storage:
            self.value._local_tensor.untyped_storage().resize_(0)

    def refill(self, fresh: torch.Tensor | None = None) -> None:
        """Gather again (or take ``fresh``, gathered by the scheduler) into the freed storage,
        without touching autograd's version counter."""
        if self.resident:
            return
        if fresh is None:
            with torch.no_grad():
                if self.reducer is None:
                    fresh = _cast(self.param, self.dtype).redistribute(self.mesh, self.run_placements)._local_tensor
                else:
                    fresh = gather(self.param, self.mesh, self.run_placements, self.reducer.stats, self.dtype)._local_tensor
        self.refill_target().copy_(fresh)

    def refill_target(self) -> torch.Tensor:
        """The freed storage, allocated again, as a new tensor to write the gathered values into.
        A new tensor over the same storage has its own version counter, so writing through it does
        not invalidate the tensors autograd saved from the gathered parameter."""
        local = self.value._local_tensor
        local.untyped_storage().resize_(self.nbytes)
        view = torch.empty(0, dtype=local.dtype, device=local.device)
        view.set_(local.untyped_storage(), local.storage_offset(), local.size(), local.stride())
        return view

    def _grad_hook(self):
        """The gathered copy's post-accumulate hook; its role's ``takes_local`` lets a static step's gradient
        hand-over (vescale.static.boundary) give it the local gradient and its spec directly, where
        nothing else would see the DTensor gradient: no DTensor made, set and taken back."""

        def grad_ready(value: DTensor) -> None:
            grad, value.grad = value.grad, None
            self._take_grad(grad._local_tensor, grad._spec)

        return declare_grad_hook(grad_ready, takes_local=self._take_grad)

    def _take_grad(self, local: torch.Tensor, spec: DTensorSpec) -> None:
        """Bucketed mode: the gathered copy's gradient goes to the reducer; the copy is freed. If
        another copy of the parameter still waits for its gradient (a tied parameter used in two
        units), the reducer holds this one and sums them: one reduce-scatter."""
        plan = self.reducer.plan_of(self.param, spec)
        if plan is None:  # no bucketed form: reduced on its own
            grad = self.reducer.reduce_alone(self.param, DTensor(local, spec, requires_grad=False))
            local, spec, plan = grad._local_tensor, grad._spec, NOTHING
        gathered = self.state.gathered
        more = any(g is not self and g.value.requires_grad for g in gathered)
        self.reducer.add_local(self.param, local, spec.placements, plan, more_coming=more, outside_autograd=True)
        self.free()
        if self in gathered:
            gathered.remove(self)


def _redistributed(param: DTensor, mesh: DeviceMesh, placements: tuple, dtype=None, reduce_dtype=None) -> DTensor:
    """Per-tensor mode: ``param`` redistributed to its RUN placements, autograd-tracked, with
    ``vescale.comm.moves``' backward, which takes the gradient to the at-rest layout one split at a
    time where DTensor's own backward would get it wrong (a fused bias's interleaved gradient into
    its nested ZeRO shard). Over mesh dims of one rank DTensor's redistribute aliases the shard.
    Mixed precision (``dtype`` other than the parameter's): ``_CastGather``."""
    if dtype is not None and dtype != param.dtype:
        return _CastGather.apply(param, placements, dtype, reduce_dtype or dtype)
    if all(a == b or mesh.size(i) == 1 for i, (a, b) in enumerate(zip(param.placements, placements))):
        return param.redistribute(mesh, placements)
    return moves.redistribute(param, placements)


def _cast(param: DTensor, dtype: torch.dtype) -> DTensor:
    return param if dtype == param.dtype else param.to(dtype)


class _CastGather(torch.autograd.Function):
    """Per-tensor mode under mixed precision: the shard cast to the compute dtype, then gathered
    (the collective moves the compute dtype's bytes); backward casts the gradient to the reduce
    dtype before it is reduced to the shard's layout (``moves.relayout``) and hands it back in the
    parameter's dtype. (Autograd would hand a redistribution's backward the gradient in its
    forward's dtype: reducing in another dtype needs one node for the whole gather.)"""

    @staticmethod
    def forward(ctx: Any, param: DTensor, placements: tuple, dtype: torch.dtype, reduce_dtype: torch.dtype) -> DTensor:
        ctx.placements, ctx.dtype, ctx.reduce_dtype = tuple(param.placements), param.dtype, reduce_dtype
        return _redistributed(_cast(param.detach(), dtype), param.device_mesh, placements)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor, None, None, None]:
        grad = moves.relayout(_in_dtype(grad, ctx.reduce_dtype), ctx.placements)
        return _in_dtype(grad, ctx.dtype), None, None, None


def per_tensor_gather(
    param: DTensor, mesh: DeviceMesh, run_placements: Sequence[Placement], policy: MixedPrecision | None = None
) -> GatheredParam:
    """Per-tensor mode: ``param``'s gathered copy for this use. Uses within one training forward
    (a tied parameter's modules, a module called twice) share one copy, gathered again in place
    if it was freed in between: one autograd node, so the contributions are summed before its one
    reduction."""
    state = zero_state(param)
    g = state.shared_gather
    run = tuple(run_placements)
    if g is not None and g.forward == _forward[0] and g.run_placements == run and torch.is_grad_enabled():
        g.refill()
        return g
    g = GatheredParam(param, mesh, run, policy=policy)
    if torch.is_grad_enabled():
        state.shared_gather = g
    return g


def _run_spec(state: ZeroParamState, param: DTensor, mesh: DeviceMesh, placements: tuple, dtype: torch.dtype) -> DTensorSpec:
    cached = state.run_spec
    if cached is None or (cached.placements is not placements and cached.placements != placements) or (
        cached.mesh is not mesh and cached.mesh != mesh
    ) or cached.tensor_meta.dtype != dtype:
        meta = TensorMeta(param.shape, param.stride(), dtype)
        cached = state.run_spec = DTensorSpec(mesh, placements, tensor_meta=meta)
    return cached


@functools.lru_cache(maxsize=None)
def unit_of(path: str) -> str:
    """The gather unit of a module: its path up to the first index (``model.layers.3``), or "" ."""
    m = re.match(r"^(.*?\.\d+)(\.|$)", path) or re.match(r"^(\d+)(\.|$)", path)
    return m.group(1) if m else ""


class GatherScheduler:
    """Unit gathers with one-unit-ahead prefetch, in forward and backward (bucketed mode)."""

    def __init__(self, mesh: DeviceMesh, reducer, prefetch: bool = True, policy=None):
        self.mesh, self.reducer, self.prefetch = mesh, reducer, prefetch
        self.policy = policy  # mixed precision: units gathered in the compute dtype
        self.units: dict[str, list[tuple[nn.Module, str, tuple]]] = {}
        self.order: list[str] = []  # units in first-use order of the last forward
        self.bwd_order: list[str] = []  # units in refill order of the last backward
        self.stats: collections.Counter = collections.Counter()  # prefetches used, per direction
        self._reset_forward()
        self._bwd: list[str] = []
        self._refills: dict[str, tuple[GroupGather, list[GatheredParam]]] = {}
        self._bwd_queued = False
        # (unit, "forward" | "backward") -> the GatherProgram of its last gather: planned once,
        # reused while the unit gathers the same parameters.
        self._programs: dict[tuple[str, str], GatherProgram] = {}
        # unit -> (its forward GatherProgram, a GatheredParam.slot per item of its collectives, None
        # for parameters gathered alone): the gathered parameters a training forward reuses.
        self._slots: dict[str, tuple[GatherProgram, list]] = {}
        # unit -> the item (of its last forward gather) each of its (module, tensor) entries takes:
        # a parameter several of its modules hold (tied) is one item.
        self._items_of: dict[str, list[int]] = {}
        self.keep_for_backward = True
        self._released: list[GatheredParam] = []  # used by this forward, freed at its next unit gather

    def register(self, module: nn.Module, path: str, entries: Iterable[Entry]) -> None:
        self.units.setdefault(unit_of(path), []).extend((module, e.tensor, tuple(e.targets)) for e in entries)

    # -- forward ---------------------------------------------------------------------------------

    def _reset_forward(self) -> None:
        self._fwd: list[str] = []
        self._inflight: dict[str, GroupGather] = {}
        self._ready: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
        self.live: dict[str, list[GatheredParam]] = {}

    def begin_forward(self) -> None:
        for g in self._inflight.values():  # predicted but not used: finish it (all ranks did launch it)
            g.finish()
        self._release_ready()
        self._free_released()  # kept by a forward that no backward followed: its refill hooks regather
        self._reset_forward()

    def release(self, gathered: list[GatheredParam]) -> None:
        """Forward is done with ``gathered`` (they wait for backward in ``zero_state(param).gathered``):
        free them now, or, with ``keep_for_backward``, when this forward gathers another unit.
        A copy another module of its unit has still to take (a tied parameter) stays gathered."""
        if self.keep_for_backward and torch.is_grad_enabled():
            self._released.extend(gathered)
        else:
            waiting = self._waiting()
            for g in gathered:
                if id(g) not in waiting:
                    g.free()

    def _free_released(self) -> None:
        waiting = self._waiting()
        for g in self._released:
            if id(g) not in waiting:  # released again after its last module ran
                g.free()
        self._released = []

    def _waiting(self) -> set[int]:
        """The gathered copies that modules of this forward have still to take."""
        return {id(x) for ready in self._ready.values() for x in ready.values()}

    def end_forward(self) -> None:
        if self._fwd:
            self.order = self._fwd
        for g in self._inflight.values():
            g.finish()
        self._release_ready()
        self._inflight, self._ready = {}, {}

    def _release_ready(self) -> None:
        """Free the slots gathered for modules that did not run (their storage is the slot's own)."""
        for ready in self._ready.values():
            for x in ready.values():
                if isinstance(x, GatheredParam):
                    x.free()

    def _unit_slots(self, unit: str, gg: GroupGather) -> list:
        """The unit's slots: one per parameter of its collectives that takes a gradient (a frozen
        one is gathered afresh each time, dropped after its last use as before)."""
        held = self._slots.get(unit)
        if held is None or held[0] is not gg.program or not _slots_fit(held[1], gg.items, gg.program.dtypes):
            slots: list = [None] * len(gg.items)
            for c in gg.program.collectives:
                for i, t in zip(c.idx, c.plans):
                    p, run = gg.items[i]
                    if p.requires_grad:
                        slots[i] = GatheredParam.slot(p, self.mesh, run, self.reducer, t.out[0], self.policy)
            held = self._slots[unit] = (gg.program, slots)
        return held[1]

    def _launch_unit(self, unit: str) -> GroupGather:
        """The unit's gather: each parameter once, however many of its modules hold it."""
        items: list = []
        first: dict = {}
        index: list = []
        for m, t, run in self.units[unit]:
            p = _stored(m, t)
            key = (id(p), run)
            if key not in first:
                first[key] = len(items)
                items.append((p, run))
            index.append(first[key])
        self._items_of[unit] = index
        return self._gather(unit, "forward", items)

    def _gather(self, unit: str, direction: str, items: list) -> GroupGather:
        program = self._programs.get((unit, direction))
        if program is None or not program.matches(items):
            dtype_of = None if self.policy is None else self.policy.compute_dtype
            program = self._programs[(unit, direction)] = GatherProgram(items, self.mesh, dtype_of)
        return GroupGather(items, self.mesh, self.reducer.stats, program)

    def take(self, module: nn.Module, path: str, entries: Sequence[Entry]) -> list[GatheredParam]:
        """The module's gathered parameters, from its unit's gather (made now, or prefetched)."""
        unit = unit_of(path)
        if unit not in self._ready and unit not in self._fwd:
            self._free_released()  # a new unit: what forward used before it is done with until backward
            self._fwd.append(unit)
            if unit in self._inflight:
                self.stats["forward_prefetched"] += 1
            else:
                self._inflight[unit] = self._launch_unit(unit)
            nxt = _after(self.order, unit)
            if self.prefetch and nxt is not None and nxt not in self._fwd and nxt not in self._inflight:
                self._inflight[nxt] = self._launch_unit(nxt)
        if unit in self._inflight:
            gg = self._inflight.pop(unit)
            keys = [(id(m), t) for m, t, _ in self.units[unit]]
            if torch.is_grad_enabled():  # into the unit's slots (made once), where it has them
                slots = self._unit_slots(unit, gg)
                gathered = gg.wait_into([s.refill_target() if s is not None else None for s in slots])
                got = [s or x for s, x in zip(slots, gathered)]
            else:  # an evaluation forward: fresh copies, dropped after use
                got = gg.wait()
            self._ready[unit] = {k: got[i] for k, i in zip(keys, self._items_of[unit])}
        ready = self._ready.get(unit, {})
        out = []
        for e in entries:
            got = ready.pop((id(module), e.tensor), None)  # None: called again; gathered alone
            if not isinstance(got, GatheredParam):
                raw, got = got, GatheredParam(_stored(module, e.tensor), self.mesh, e.targets, self.reducer, got, self.policy)
                if raw is not None:  # other modules holding the parameter take this copy too
                    for k, x in ready.items():
                        if x is raw:
                            ready[k] = got
            out.append(got)
        if torch.is_grad_enabled():  # kept for backward's unit refill; no-grad copies just go
            live = self.live.setdefault(unit, [])
            live.extend(g for g in out if not any(g is h for h in live))
        return out

    def held_bytes(self) -> int:
        """Bytes of gathered copies this scheduler holds now: resident gathered parameters, gathered
        ones waiting for their module, and gathers in flight (for tests of ZeRO-3's memory)."""
        live = sum(g.nbytes for gs in self.live.values() for g in gs if g.resident and g.owns_storage)
        ready = sum(
            (x.nbytes if x.resident else 0) if isinstance(x, GatheredParam) else x.untyped_storage().nbytes()
            for r in self._ready.values() for x in r.values()
        )
        flight = sum(g.out_bytes for g in self._inflight.values())
        return live + ready + flight

    # -- backward --------------------------------------------------------------------------------

    def refill(self, path: str, gathered: list[GatheredParam]) -> None:
        """Backward reached a module: bring back its whole unit with one collective (or take the
        prefetched one), and start bringing back the next unit."""
        unit = unit_of(path)
        if not self._bwd_queued:
            self._bwd_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)
        if not self._bwd or self._bwd[-1] != unit:  # a unit kept from forward comes up again at its end
            self._bwd.append(unit)
        todo = [g for g in gathered if not g.resident]
        if todo:
            if unit in self._refills:
                self.stats["backward_prefetched"] += 1
            else:
                self._refills[unit] = self._launch_refill(unit, todo)
            self._finish_refill(unit)
            for g in todo:
                if not g.resident:  # not in the unit's gather: gathers alone
                    g.refill()
        order = self.bwd_order or list(reversed(self.order))
        nxt = _after(order, unit)
        if self.prefetch and nxt is not None and nxt != unit and nxt not in self._refills:
            waiting = [g for g in self.live.get(nxt, []) if _awaited(g)]
            if waiting:
                self._refills[nxt] = self._launch_refill(nxt, waiting)

    def _launch_refill(self, unit: str, extra: list[GatheredParam]):
        todo = list({id(g): g for g in [*self.live.get(unit, []), *extra] if _awaited(g) and g.owns_storage}.values())
        return self._gather(unit, "backward", [(g.param, g.run_placements) for g in todo]), todo

    def _finish_refill(self, unit: str) -> None:
        """Write the unit's gather straight into its parameters' freed storage (the rest of the
        unit is needed by the modules backward reaches next)."""
        gg, todo = self._refills.pop(unit)
        gg.wait_into([g.refill_target() for g in todo])

    def end_backward(self) -> None:
        self._bwd_queued = False
        for gg, _ in self._refills.values():  # prefetched but never needed: complete it
            gg.finish()
        self._refills = {}
        if self._bwd:
            self.bwd_order, self._bwd = self._bwd, []


def _awaited(g: GatheredParam) -> bool:
    """Freed, and its gradient not yet taken (a kept unit's members that backward is done with are
    freed too by then, and must not be gathered again)."""
    return not g.resident and g in g.state.gathered


def _slots_fit(slots: list, items: list, dtypes: list) -> bool:
    """The slots still stand for the parameters: the dtype they are gathered in, and none for a
    parameter frozen since they were made (a parameter unfrozen since gets one when they are made
    again: a new program)."""
    for g, (p, _), dtype in zip(slots, items, dtypes):
        if g is not None and (not p.requires_grad or g.value.dtype != dtype):
            return False
    return True


def _stored(module: nn.Module, name: str) -> DTensor:
    return module._parameters[name] if name in module._parameters else module._buffers[name]


def _after(order: list[str], unit: str) -> str | None:
    try:
        i = order.index(unit)
    except ValueError:
        return None
    return order[i + 1] if i + 1 < len(order) else None
