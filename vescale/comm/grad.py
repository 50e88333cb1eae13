"""Gradient reduction: bring each parameter's gradient to the parameter's own placements, in buckets.

Under data or sequence parallelism a weight gradient comes out of backward as ``Partial`` (each rank
holds a partial sum); under ZeRO-3 it must also be scattered to the parameter's shard. ``GradReducer``
packs such gradients into flat buffers, one collective per bucket, and writes the reduced results,
laid out like their parameters, into ``param.grad`` before ``backward()`` returns:

* **Buckets.** Gradients that need the same collective over the same mesh dimensions, with the same
  dtype, share a bucket (``bucket_mb``); a bucket is launched asynchronously as soon as it is full,
  so communication overlaps the rest of backward. The last, partly filled buckets are launched, and
  every bucket is waited for and unpacked, in a callback queued on the autograd engine, which runs
  when the backward pass ends: ``optimizer.step()`` needs no extra call.
* **N-D fusion.** A gradient Partial on several mesh dimensions (SP's TP and DP) is reduced once over
  the flattened sub-mesh (``vescale.comm.groups``), see ``vescale.comm.layout`` for the plans.
* **Accumulation.** ``with no_grad_sync(model):`` keeps micro-step gradients local (summed as
  Partial, per parameter); the next backward outside the context reduces them together with its own.

Buckets are filled in the order gradients become ready, which is the same on every rank because
every rank runs the same program (SPMD); a parameter that gets no gradient in a step is simply not
in any bucket, on every rank, and its ``grad`` is left as it was.

The seam is per parameter (``attach_grad_reduction``): a pre-accumulation hook takes the DTensor
gradient out of autograd's accumulation, ``add`` files it, and the reduced gradient lands in
``param.grad`` at the end of backward. ZeRO-3 gathers hand their gradients to ``add`` directly
(``vescale.parallel.hooks``). ``bucket_mb=None`` keeps the per-tensor path (DTensor
``redistribute`` of each gradient in its hook): the reference the buckets are tested against.
"""

from __future__ import annotations

import collections
import contextlib
import warnings
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..dispatch.metas import spec_of
from . import direct, moves
from .groups import group_of
from .layout import NOTHING, Transfer, pack_rows, reduce_plan, unpack_row
from ..precision import reduce_dtype_of
from vescale.model_state import state_of

if TYPE_CHECKING:
    from vescale._torch import DTensorSpec
    from ..precision import MixedPrecision

__all__ = ["GradReducer", "Route", "accumulate_grad", "attach_grad_reduction", "no_grad_sync", "DEFAULT_BUCKET_MB",
           "GradHookRole", "declare_grad_hook", "grad_hook_role"]

DEFAULT_BUCKET_MB = 25.0  # as torch DDP: large enough to fill the links, small enough to overlap


@dataclass
class _Entry:
    param: torch.Tensor
    local: torch.Tensor
    plan: Any  # a Transfer; a Route only until GradReducer._file lays the gradient out


@dataclass(frozen=True)
class Route:
    """A gradient reduced in two parts: ``move`` lays it out anew over the mesh dims it is not
    Partial on (no reduction; ``vescale.comm.moves``), then ``plan`` reduces it in a bucket. For a
    gradient whose layout no single bucketed collective takes to its parameter's: a fused bias's
    gradient ``(Partial, InterleavedShard(0, 3))`` goes to ``(Partial, Shard(0))`` over TP, then
    is reduce-scattered over DP into its nested ZeRO shard ``(InterleavedShard(0, 2), Shard(0))``."""

    move: Callable | None  # local tensor -> local tensor (compiled once), None where nothing moves
    plan: Transfer


@dataclass
class _Bucket:
    """Gradients for one collective: same kind, same (flattened) mesh dims, same dtype."""

    kind: str
    dims: tuple[int, ...]
    fuse: bool
    then_all_reduce: tuple[int, ...] = ()  # reduce_scatter: all-reduce the output over these dims next
    entries: list[_Entry] = field(default_factory=list)
    nbytes: int = 0
    work: object = None
    out: torch.Tensor | None = None

    def add(self, e: _Entry) -> None:
        self.entries.append(e)
        rows = e.plan.member_count * e.plan.row if self.kind == "reduce_scatter" else e.local.numel()
        self.nbytes += rows * e.local.element_size()

    def launch(self, mesh: DeviceMesh, stats: collections.Counter) -> None:
        if self.kind == "all_reduce":
            self.out = torch.cat([e.local.reshape(-1) for e in self.entries])
            # Unfused: one mesh dim at a time (the first now, the others when waited for).
            dims = self.dims if self.fuse else self.dims[:1]
            self.work = direct.all_reduce(self.out, group_of(mesh, dims), async_op=True)
        else:
            rows = torch.cat([pack_rows(e.local, e.plan) for e in self.entries], dim=1)
            self.out = rows.new_empty(rows.shape[1])
            self.work = direct.reduce_scatter(self.out, rows.reshape(-1), group_of(mesh, self.dims), async_op=True)
        stats[self.kind] += 1

    def wait(self, mesh: DeviceMesh, stats: collections.Counter) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yields (param, reduced local tensor) per entry."""
        direct.wait(self.work)
        if self.kind == "all_reduce" and not self.fuse:
            for d in self.dims[1:]:
                direct.all_reduce(self.out, group_of(mesh, (d,)))
                stats[self.kind] += 1
        if self.then_all_reduce:  # the scattered shards, Partial on these dims until now
            direct.all_reduce(self.out, group_of(mesh, self.then_all_reduce))
            stats["all_reduce"] += 1
        at = 0
        for e in self.entries:
            n = e.local.numel() if self.kind == "all_reduce" else e.plan.row
            piece = self.out[at : at + n]
            at += n
            yield e.param, (piece.view(e.local.shape) if self.kind == "all_reduce" else unpack_row(piece, e.plan))


class GradReducer:
    """Bucketed, fused, overlapped reduction of the gradients of one parallelised model."""

    def __init__(self, mesh: DeviceMesh, bucket_mb: float = DEFAULT_BUCKET_MB, fuse: bool = True, policy=None):
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive (or None for per-tensor reduction), got {bucket_mb}")
        self.mesh, self.bucket_bytes, self.fuse = mesh, int(bucket_mb * 2**20), fuse
        # A vescale.MixedPrecision (or None): gradients are reduced in its reduce dtype, and land
        # in param.grad in the parameter's own dtype.
        self.policy = policy
        self.sync = True
        self.stats: collections.Counter = collections.Counter()  # collectives launched, by kind
        self.launched_during_backward = 0  # buckets that filled up and left before backward ended
        self._pending: dict[tuple, _Entry] = {}  # no-sync accumulation, by (param, grad placements)
        self._open: dict[tuple, _Bucket] = {}
        self._launched: list[_Bucket] = []
        self._ready: list[tuple[torch.Tensor, torch.Tensor]] = []  # reduced without a bucket
        self._queued = False
        self._outside_autograd: set[int] = set()  # ids of parameters fed by add_local(outside_autograd=True)
        # id(param) -> (param spec, gradient spec, plan): a plan depends on those two specs only, and
        # static steps hand the same gradient spec over every step, so it is worked out once.
        self._plans: dict[int, tuple] = {}

    def plan(self, param: DTensor, grad: DTensor) -> Transfer | Route | None:
        """The collective for this gradient; ``NOTHING`` if none is needed, ``None`` if it has no
        bucketed form (the caller then redistributes it itself)."""
        return self.plan_of(param, grad._spec)

    def plan_of(self, param: DTensor, spec: DTensorSpec) -> Transfer | Route | None:
        """``plan`` for a gradient laid out as ``spec`` (a DTensorSpec)."""
        cached = self._plans.get(id(param))
        if cached is not None and cached[0] is param._spec and cached[1] is spec:
            return cached[2]
        if spec.mesh is not self.mesh and spec.mesh != self.mesh:
            plan: Transfer | Route | None = None
        else:
            plan = reduce_plan(spec.shape, self.mesh, spec.placements, param.placements)
            if plan is None:
                plan = _route(spec, param._spec)
        self._plans[id(param)] = (param._spec, spec, plan)
        return plan

    def reduce_alone(self, param: DTensor, grad: DTensor) -> DTensor:
        """A gradient with no bucketed form (``plan_of`` is None) laid out like ``param`` now, per
        tensor (``vescale.comm.moves.relayout``: DTensor's redistribute where it is right)."""
        dtype = reduce_dtype_of(self.policy, param)
        return _in_dtype(moves.relayout(_in_dtype(grad, dtype), param.placements), param.dtype)

    def add(self, param: DTensor, grad: DTensor, plan: Transfer | Route) -> None:
        """File a gradient of ``param`` (called from backward hooks)."""
        self.add_local(param, grad._local_tensor, grad.placements, plan)

    def add_local(self, param: DTensor, local: torch.Tensor, placements: tuple, plan: Transfer | Route,
                  more_coming: bool = False, outside_autograd: bool = False) -> None:
        """``add`` for a gradient given as its local tensor and placements. ``more_coming``: another
        gradient of ``param`` arrives later in this backward (a tied parameter's other gathered
        copy): this one waits, summed with it, so the parameter is reduced once (if the two come
        in other layouts, each is reduced on its own). ``outside_autograd``: autograd computed it
        for a copy of ``param`` (ZeRO-3's gathered one), so ``param``'s own hooks run when the
        reduced gradient lands (``_accumulate``)."""
        if outside_autograd:
            self._outside_autograd.add(id(param))
        if not self.sync or more_coming:
            key = (id(param), tuple(placements))
            held = self._pending.get(key)
            self._pending[key] = _Entry(param, local if held is None else held.local + local, plan)
            if self.sync:
                self._queue_finish()  # files it at the end of backward if no other gradient comes
            return
        if self._pending:  # micro-steps accumulated under no_grad_sync
            held = self._pending.pop((id(param), tuple(placements)), None)
            if held is not None:
                local = held.local + local
        self._queue_finish()
        self._file(_Entry(param, local, plan))

    def _file(self, e: _Entry) -> None:
        if isinstance(e.plan, Route):  # laid out anew first (after any no-sync accumulation)
            e = _Entry(e.param, e.local if e.plan.move is None else e.plan.move(e.local), e.plan.plan)
        if e.plan is NOTHING:
            self._ready.append((e.param, e.local))
            return
        dtype = reduce_dtype_of(self.policy, e.param)
        if e.local.dtype != dtype:  # mixed precision: reduced in the policy's dtype (buckets are per dtype)
            e = _Entry(e.param, e.local.to(dtype), e.plan)
        key = (e.plan.kind, e.plan.dims, e.plan.then_all_reduce, e.local.dtype, e.local.device)
        bucket = self._open.setdefault(key, _Bucket(e.plan.kind, e.plan.dims, self.fuse, e.plan.then_all_reduce))
        bucket.add(e)
        if bucket.nbytes >= self.bucket_bytes:
            self._launch(self._open.pop(key))
            self.launched_during_backward += 1

    def _launch(self, bucket: _Bucket) -> None:
        bucket.launch(self.mesh, self.stats)
        self._launched.append(bucket)

    def _queue_finish(self) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def finish(self) -> None:
        """Launch what is left, wait for every bucket, write the results into ``param.grad``.
        Runs at the end of backward (queued callback); the same order on every rank. A collective
        that fails here (another rank stopped) gets a note naming what the other ranks reported."""
        try:
            self._finish()
        except Exception as e:
            from ..parallel.faults import note_peer_failures

            note_peer_failures(e, "the gradient reduction at the end of backward")
            raise

    def unfinished(self) -> bool:
        """A backward filed gradients here and never reached its end (an exception in backward)."""
        return self._queued

    def abandon(self) -> None:
        """Forget what a backward that did not finish left behind (its buckets' collectives, if any
        were launched, stay unpaired: the caller stops the run, see ``vescale.parallel.faults``)."""
        self._queued = False
        self._open.clear()
        self._launched.clear()
        self._ready.clear()

    def _finish(self) -> None:
        self._queued = False
        if self.sync:
            for e in self._pending.values():  # accumulated in earlier micro-steps, no gradient now
                self._file(e)
            self._pending.clear()
        for key in list(self._open):
            self._launch(self._open.pop(key))
        launched, self._launched = self._launched, []
        outside = self._outside_autograd
        for bucket in launched:
            for param, local in bucket.wait(self.mesh, self.stats):
                _accumulate(param, local, id(param) in outside)
        ready, self._ready = self._ready, []
        for param, local in ready:
            _accumulate(param, local, id(param) in outside)


def _route(grad, param) -> Route | None:
    """``Route`` for a gradient laid out as ``grad`` (a DTensorSpec) to ``param``'s spec: laid out
    as ``param`` except on the mesh dims where it is Partial (and the parameter is not), then
    reduced by one bucketed collective; None where that reduction has no bucketed form either."""
    mid = tuple(g if g.is_partial() and not p.is_partial() else p for g, p in zip(grad.placements, param.placements))
    if mid == tuple(grad.placements) or mid == tuple(param.placements):
        return None
    plan = reduce_plan(grad.shape, grad.mesh, mid, param.placements)
    if plan is None or plan is NOTHING:
        return None
    target = spec_of(grad.mesh, mid, grad.tensor_meta)
    return Route(moves.compile_move(grad, target), plan)


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor, skip: Callable[[Callable], bool] = lambda hook: False) -> None:
    """What autograd's AccumulateGrad does with ``grad`` on the leaf ``param`` (outside
    ``create_graph``): tensor hooks, then ``param.grad`` set (or added to in place), then the
    post-accumulate hooks; hooks for which ``skip`` is true are left out. For a gradient that
    reaches ``param`` outside autograd: a Static Eager step's hand-over, a ZeRO-3 reduce-scatter."""
    for hook in tuple((param._backward_hooks or {}).values()):
        replaced = None if skip(hook) else hook(grad)
        if replaced is not None:
            grad = replaced
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)
    for hook in tuple((param._post_accumulate_grad_hooks or {}).values()):
        if not skip(hook):
            hook(param)


@dataclass(frozen=True)
class GradHookRole:
    """What one of vescale's gradient hooks on a parameter does, for the code that hands gradients
    over outside autograd (Static Eager's parameter shadows, ZeRO-3 reduce-scatters)."""

    idle_for: Callable[[Any], bool] | None = None  # (gradient spec) -> the hook does nothing with it
    takes_local: Callable[[torch.Tensor, Any], None] | None = None  # takes (local gradient, spec) directly
    reduction: bool = False  # vescale.comm's gradient reduction (skipped when the reducer itself hands over)


_HOOK_ROLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # hook function -> GradHookRole


def declare_grad_hook(hook: Callable, **role: Any) -> Callable:
    """Record ``hook``'s ``GradHookRole``; returns the hook."""
    _HOOK_ROLES[hook] = GradHookRole(**role)
    return hook


def grad_hook_role(hook: Callable) -> GradHookRole | None:
    """The role declared for ``hook`` (None: a user's hook, or one without a role)."""
    return _HOOK_ROLES.get(hook)


def _is_reduction_hook(hook) -> bool:
    role = _HOOK_ROLES.get(hook)
    return role is not None and role.reduction


def _accumulate(param: DTensor, local: torch.Tensor, outside_autograd: bool = False) -> None:
    """``param.grad += reduced`` where ``reduced`` is already laid out like ``param`` (in the
    parameter's own dtype: mixed precision reduces in another, or computes a gathered copy's in another).
    ``outside_autograd``: the gradient never passed autograd's accumulation on ``param`` (ZeRO-3:
    autograd fed a gathered copy), so the parameter's own hooks, registered by the user, run here on
    the reduced gradient, as on one device and as FSDP2 runs post-accumulate hooks (vescale's
    reduction hooks, meant for a gradient autograd hands over, are left out)."""
    if local.dtype != param.dtype:
        local = local.to(param.dtype)
    if outside_autograd and (param._backward_hooks or param._post_accumulate_grad_hooks):
        accumulate_grad(param, DTensor(local, param._spec, requires_grad=False), skip=_is_reduction_hook)
        return
    if param.grad is None:
        # The parameter's own spec: the reduced gradient is laid out exactly like it.
        param.grad = DTensor(local, param._spec, requires_grad=False)
    else:
        param.grad._local_tensor.add_(local)


def _per_tensor_hook(param: DTensor, policy=None):
    dtype = reduce_dtype_of(policy, param)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            try:
                return _in_dtype(moves.relayout(_in_dtype(grad, dtype), param.placements), param.dtype)
            except Exception as e:
                from ..parallel.faults import note_peer_failures

                note_peer_failures(e, "the per-tensor gradient reduction in backward")
                raise
        return grad

    return hook


# A user's post-accumulate hook on a parameter whose gradient autograd accumulates and the buckets
# reduce at the end of backward runs before that reduction (as under DDP), where param.grad does not
# hold this backward's gradient yet. (ZeRO-3's parameters are fed outside autograd: their hooks run
# after the reduce-scatter, see _accumulate.)
_EARLY_POST_HOOK = (
    "vescale: a post-accumulate-grad hook on a parameter with bucketed gradient reduction runs before "
    "the reduction, which ends with backward: param.grad does not hold this backward's gradient yet "
    "when the hook reads it. Pass bucket_mb=None to vescale.parallelize (each gradient reduced in "
    "autograd, before the hook runs), or act on gradients after backward() returns."
)


def _bucketed_hooks(param: DTensor, reducer: GradReducer) -> list:
    """A pre-accumulation hook moves ``param.grad`` aside so that autograd stores the raw gradient
    alone (no Partial + Replicate addition, which DTensor would reduce per tensor); the
    post-accumulation hook files that gradient with the reducer and puts the old ``grad`` back."""
    state: dict[str, Any] = {"taken": False, "kept": None, "plan": None}

    def pre(grad: torch.Tensor) -> torch.Tensor:
        plan = reducer.plan(param, grad) if isinstance(grad, DTensor) else NOTHING
        if plan is None:  # no bucketed form: reduce this one on its own, as the per-tensor path does
            return reducer.reduce_alone(param, grad)
        if plan is NOTHING:
            return grad
        state.update(taken=True, kept=param.grad, plan=plan)
        param.grad = None
        return grad

    def post(p: torch.Tensor) -> None:
        if state["taken"]:
            grad, p.grad = p.grad, state["kept"]
            plan = state["plan"]
            state.update(taken=False, kept=None, plan=None)
            reducer.add(p, grad, plan)
            if not state.get("warned") and any(not _is_reduction_hook(h) for h in p._post_accumulate_grad_hooks.values()):
                state["warned"] = True
                warnings.warn(_EARLY_POST_HOOK, stacklevel=2)

    # Both hooks do nothing with a gradient that needs no reduction: Static Eager's parameter
    # hand-over may then wait for the end of backward (vescale.static.boundary.HandOvers).
    def idle_for(spec: DTensorSpec) -> bool:
        return reducer.plan_of(param, spec) is NOTHING

    declare_grad_hook(pre, idle_for=idle_for, reduction=True)
    declare_grad_hook(post, idle_for=idle_for, reduction=True)
    return [param.register_hook(pre), param.register_post_accumulate_grad_hook(post)]


def _in_dtype(d: DTensor, dtype: torch.dtype) -> DTensor:
    """A gradient DTensor (no autograd) in ``dtype``: the local tensor cast, the layout kept (a
    Partial gradient's cast is taken before its sum, which is what reducing in ``dtype`` means)."""
    if d.dtype == dtype:
        return d
    local = d._local_tensor.to(dtype)
    return DTensor.from_local(local, d.device_mesh, d.placements, run_check=False, shape=d.shape, stride=d.stride())


def attach_grad_reduction(
    params: Iterable[torch.Tensor], reducer: GradReducer | None = None, policy: MixedPrecision | None = None
) -> list:
    """Register the reduction on every DTensor parameter that requires grad: bucketed through
    ``reducer``, or per tensor when it is None (in ``policy``'s reduce dtype, a
    ``vescale.MixedPrecision`` or None). Returns the hook handles."""
    handles = []
    for p in params:
        if isinstance(p, DTensor) and p.requires_grad:
            handles += [p.register_hook(_per_tensor_hook(p, policy))] if reducer is None else _bucketed_hooks(p, reducer)
    return handles


@contextlib.contextmanager
def no_grad_sync(model: torch.nn.Module) -> Iterator[None]:
    """Skip gradient reduction for the backward passes inside (accumulation micro-steps): their
    gradients stay local, and the first backward after the block reduces them with its own, so
    ``param.grad`` then equals what reducing every micro-step would give. A model with per-tensor
    reduction (``bucket_mb=None``) reduces every step regardless."""
    reducer = state_of(model).reducer
    if reducer is None:
        if state_of(model).ir is None:
            raise ValueError("no_grad_sync: the model is not parallelized (call vescale.parallelize first)")
        yield
        return
    previous, reducer.sync = reducer.sync, False
    try:
        yield
    finally:
        reducer.sync = previous
