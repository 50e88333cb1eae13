"""Module hooks built from the optimised Plan IR: per module at most one pre-hook, one post-hook
and one always-called cleanup hook (it gives the module its own parameters back even when forward
raised).

* forward_pre: RUN-phase gathers of the module's own parameters (ZeRO-3), then input redistribution.
* forward: output redistribution, then the release of gathered parameters.
* factory: a TorchFunctionMode, active only during the module's forward, that turns tensors made by
  factory functions (torch.zeros, arange, ...) into DTensors with the planned placement.

ZeRO-3 (``GatheredParam``, ``GatherScheduler`` in ``vescale.parallel.zero``): the pre-hook swaps the
module's at-rest parameter for its gathered copy; the post-hook frees the copy and arranges for it to
be gathered again when backward reaches one of the module's outputs. Per-tensor mode gathers each
parameter with DTensor's ``redistribute``; bucketed mode gathers whole units through the scheduler.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.overrides import TorchFunctionMode

from ..plan.ir import Entry, PlanError
from ..plan.lower import KeyPattern, forward_arg_names
from .placing import _fmt, agrees, moves_nothing, place, place_entry, relabel
from .faults import FaultReporter, note_peer_failures
from .zero import GatheredParam, next_forward, per_tensor_gather
from .._torch import PATCHES
from ..model_state import WeakStates

if TYPE_CHECKING:
    from ..comm.grad import GradReducer
    from ..precision import MixedPrecision
    from .contract import InputContract
    from .faults import StepCheck
    from .zero import GatherScheduler

__all__ = ["install_module_hooks", "GatheredParam", "CallState", "call_state"]

@dataclasses.dataclass
class CallState:
    """What one forward call of a module carries between vescale's hooks on it (the plan's and
    Static Eager's), kept per module in a weak table rather than in the module's ``__dict__``."""

    io_placed: bool = False  # Static Eager moved the planned inputs / outputs itself: the plan's hooks leave them be
    grad_checked: list | None = None  # (name, parameter) swapped for a view whose gradient is checked
    swapped: list | None = None  # Static Eager: parameters swapped for their local tensors, for this call
    shares: list | None = None  # Static Eager recording: the gradient shares this call expects

    def take_io_placed(self) -> bool:
        """Whether the inputs / outputs were placed, and forget it (it holds for one hand-over)."""
        placed, self.io_placed = self.io_placed, False
        return placed


call_state = WeakStates(CallState)  # call_state(mod): the module's CallState, made on first use


# ---------------------------------------------------------------------------------------------
# ZeRO-3 gathers
# ---------------------------------------------------------------------------------------------


def _free_after_grad(g: GatheredParam) -> None:
    """Per-tensor mode: once ``g``'s parameter's gradient is accumulated, its gathered copies are no
    longer needed."""
    state = g.state
    if state.free_hook:
        return

    def hook(p: torch.Tensor) -> None:
        for g in state.gathered:
            g.free()
        state.gathered.clear()

    g.param.register_post_accumulate_grad_hook(hook)
    state.free_hook = True


# ---------------------------------------------------------------------------------------------
# Inputs and outputs
# ---------------------------------------------------------------------------------------------


def _input_keys(e: Entry, kwargs) -> list:
    """The argument names / positions an input entry places in this call."""
    if isinstance(e.key, KeyPattern):
        return [k for k in kwargs if re.fullmatch(e.key, k)]
    return [e.key]


def _place_inputs(args, kwargs, entries: list[Entry], names: list[str], mesh, path: str, first: bool):
    """``names``: the forward's argument names, read once at install time (not per call). At the
    module's first call every entry must place something: a key that matches no argument passed is
    a plan that silently does nothing (later calls may leave an optional argument out)."""
    args = list(args)
    for e in entries:
        placed = False
        for key in _input_keys(e, kwargs):
            what = f"{path or '<root>'}.<in>[{key}]"
            pos = names.index(key) if key in names else key  # a **kwargs name has no position
            if isinstance(key, str) and key in kwargs:
                kwargs[key] = place_entry(kwargs[key], mesh, e, what)
                placed = True
            elif isinstance(pos, int) and pos < len(args):
                args[pos] = place_entry(args[pos], mesh, e, what)
                placed = True
        if first and not placed:
            passed = [names[i] if i < len(names) else str(i) for i in range(len(args))] + list(kwargs)
            raise PlanError(
                f"{path or '<root>'}.<in>[{e.key}] (plan statement(s) #{', #'.join(map(str, e.statements))}) "
                f"matched no argument of the module's first call, which passed {passed}; fix the key "
                "(keys are full-match regular expressions) or drop the statement"
            )
    return tuple(args), kwargs


def _place_outputs(output, entries: list[Entry], mesh, path: str):
    for e in entries:
        what = f"{path or '<root>'}.<out>[{e.key}]"
        if isinstance(output, torch.Tensor):
            if e.key != 0:
                raise PlanError(f"{what}: the module returns a single tensor; use <out>")
            output = place_entry(output, mesh, e, what)
        elif isinstance(output, (tuple, list)):
            i = e.key
            if not isinstance(i, int) or not -len(output) <= i < len(output):
                raise PlanError(f"{what}: the module returns a {type(output).__name__} of {len(output)}; no element {i!r}")
            items = list(output)
            items[i] = place_entry(items[i], mesh, e, what)
            output = type(output)(items) if type(output) in (tuple, list) else type(output)(*items)
        elif isinstance(output, dict):
            keys = [k for k, v in output.items() if v is not None]
            if isinstance(e.key, int):
                fields = [keys[e.key]] if e.key < len(keys) else []
            else:  # a full-match regular expression over the fields
                fields = [k for k in keys if re.fullmatch(e.key, k)]
            if not fields:
                raise PlanError(f"{what}: the module's output has no field matching {e.key!r}; fields: {keys}")
            for k in fields:
                output[k] = place_entry(output[k], mesh, e, f"{path or '<root>'}.<out>[{k}]")
        else:
            raise PlanError(f"{what}: cannot place an output of type {type(output).__name__}")
    return output


# ---------------------------------------------------------------------------------------------
# Factories
# ---------------------------------------------------------------------------------------------

_FACTORIES = {
    torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.eye, torch.linspace,
    torch.tensor, torch.as_tensor, torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like,
}


class _FactoryMode(TorchFunctionMode):
    """Turns plain tensors made by factory functions into DTensors with planned placements."""

    def __init__(self, mesh: DeviceMesh, targets, path: str):
        super().__init__()
        self.mesh, self.targets, self.path = mesh, targets, path

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _FACTORIES and isinstance(out, torch.Tensor) and not isinstance(out, DTensor):
            out = place(out, self.mesh, self.targets, f"{self.path}.<factory> {func.__name__}")
        return out


# ---------------------------------------------------------------------------------------------
# Installation
# ---------------------------------------------------------------------------------------------


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """Apply ``fn`` to every tensor in a module output: tensors, tuples/lists, dicts (incl. HF
    ModelOutput) and dataclasses (the last two are updated in place, as their identity may matter)."""
    return _map_named_tensors(lambda _, t: fn(t), obj)


def _map_named_tensors(fn: Callable[[str, torch.Tensor], torch.Tensor], obj: Any, path: str = "") -> Any:
    """``_map_tensors`` that also tells ``fn`` where each tensor sits: ``""`` for the output itself,
    ``[0]`` for a tuple item, ``.loss`` for a dict key or dataclass field (nested: ``.hidden[1]``)."""
    if isinstance(obj, torch.Tensor):
        return fn(path, obj)
    if isinstance(obj, (tuple, list)):
        items = [_map_named_tensors(fn, v, f"{path}[{i}]") for i, v in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            obj[k] = _map_named_tensors(fn, v, f"{path}.{k}")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            object.__setattr__(obj, f.name, _map_named_tensors(fn, getattr(obj, f.name), f"{path}.{f.name}"))
    return obj


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors ``_map_tensors`` visits, in its order; builds nothing else (it runs on every
    module output of a ZeRO-3 step)."""
    found: list[torch.Tensor] = []
    _collect_tensors(obj, found)
    return found


def _collect_tensors(obj, found: list) -> None:
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            _collect_tensors(v, found)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect_tensors(v, found)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _collect_tensors(getattr(obj, f.name), found)


def _register_once_on_grads(output: Any, fn: Callable[[], object], where: str | None = None) -> None:
    """Call ``fn`` once, when backward first reaches any tensor of ``output``. ``where`` names what
    ``fn`` does for the fault note of a collective failing in it (``note_peer_failures``)."""
    tensors = [output] if isinstance(output, torch.Tensor) else _tensors_in(output)
    tensors = [t for t in tensors if t.requires_grad]
    fired = [False]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if not fired[0]:
            fired[0] = True
            try:
                fn()
            except Exception as e:
                if where is not None:
                    note_peer_failures(e, where)
                raise
        return grad

    for t in tensors:
        t.register_hook(hook)


def release_gathered(gathered: list[GatheredParam], output: Any, scheduler: GatherScheduler | None, path: str) -> None:
    """After the forward that used ``gathered`` (and made ``output``): free them (with the scheduler:
    when it sees fit, ``GatherScheduler.release``), and gather them again when backward first
    reaches ``output`` (with the scheduler: ``path``'s whole unit, what of it is freed)."""
    if not gathered or not torch.is_grad_enabled() or not any(g.value.requires_grad for g in gathered):
        return
    for g in gathered:
        if scheduler is None:
            _free_after_grad(g)
            g.free()
        if not any(g is h for h in g.state.gathered):  # a copy several modules share: once
            g.state.gathered.append(g)
    if scheduler is None:
        _register_once_on_grads(output, lambda: [g.refill() for g in gathered], f"the ZeRO-3 re-gather of {path or '<root>'} in backward")
    else:
        scheduler.release(gathered)  # freed now, or kept for backward if forward used them last
        _register_once_on_grads(output, lambda: scheduler.refill(path, gathered), f"the ZeRO-3 re-gather of {path or '<root>'} in backward")


def gather_only(hook_entries: dict[str, list[Entry]]) -> list[Entry] | None:
    """The gather entries of a module whose plan hooks only gather ZeRO-3 parameters (no
    activation placed, no factory, no gradient note), or None."""
    pre = hook_entries.get("forward_pre", [])
    if set(hook_entries) != {"forward_pre"} or not pre or any(e.action != "gather" for e in pre):
        return None
    return pre


def install_module_hooks(
    module: nn.Module, path: str, hook_entries: dict[str, list[Entry]], mesh: DeviceMesh,
    scheduler: GatherScheduler | None = None, policy: MixedPrecision | None = None,
) -> list:
    """Install the fused hooks of one module; returns the handles. ``scheduler``: the model's
    ``GatherScheduler`` (bucketed mode: unit gathers with prefetch, gradients to the reducer), or
    None for the per-tensor path. ``policy``: a ``vescale.MixedPrecision`` (per-tensor gathers in
    its compute dtype; the scheduler has its own), or None."""
    gathers = [e for e in hook_entries.get("forward_pre", []) if e.action == "gather"]
    inputs = [e for e in hook_entries.get("forward_pre", []) if e.action in ("redist", "annotate")]
    outputs = hook_entries.get("forward", [])
    factory = hook_entries.get("factory", [])
    grad_notes = hook_entries.get("grad", [])  # plan.annotate("<param>.grad", ...): checked once
    arg_names = forward_arg_names(module)[0]
    live: list[GatheredParam] = []  # gathered for the forward call in flight
    calls = [0]  # forward calls so far: the first must find every planned input
    call = call_state(module)  # what this call carries between the hooks (Static Eager sets io_placed)
    modes: list[_FactoryMode] = []

    def pre_hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        live.clear()  # left over only if the previous forward raised
        if scheduler is not None and gathers:
            live.extend(scheduler.take(mod, path, gathers))
        else:
            for e in gathers:
                store = mod._parameters if e.tensor in mod._parameters else mod._buffers
                live.append(per_tensor_gather(store[e.tensor], mesh, e.targets, policy))
        for e, g in zip(gathers, live):
            store = mod._parameters if e.tensor in mod._parameters else mod._buffers
            store[e.tensor] = g.value  # the forward sees the gathered tensor
        if factory:
            mode = _FactoryMode(mesh, factory[0].targets, path)
            mode.__enter__()
            modes.append(mode)
        if grad_notes and calls[0] == 0 and torch.is_grad_enabled():
            _check_grads_once(mod, path, grad_notes)
        if inputs and not call.io_placed:
            args, kwargs = _place_inputs(args, kwargs, inputs, arg_names, mesh, path, calls[0] == 0)
        calls[0] += 1
        return args, kwargs

    def cleanup_hook(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """Runs even when forward raised: the module must get its own parameters back."""
        if modes:
            modes.pop().__exit__(None, None, None)
        checked, call.grad_checked = call.grad_checked, None
        for name, param in checked or ():
            mod._parameters[name] = param
        for e, g in zip(gathers, live):
            store = mod._parameters if e.tensor in mod._parameters else mod._buffers
            store[e.tensor] = g.param

    def post_hook(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if outputs and not call.io_placed:
            output = _place_outputs(output, outputs, mesh, path)
        gathered = list(live)
        live.clear()
        release_gathered(gathered, output, scheduler, path)
        return output

    handles = []
    if scheduler is not None and gathers:
        scheduler.register(module, path, gathers)
    if gathers or inputs or factory or grad_notes:
        handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
    if gathers or factory or grad_notes:
        handles.append(module.register_forward_hook(cleanup_hook, with_kwargs=True, always_call=True))
    if gathers or outputs:
        handles.append(module.register_forward_hook(post_hook, with_kwargs=True))
    return handles


def _check_grads_once(mod: nn.Module, path: str, notes: list[Entry]) -> None:
    """For this forward call, the module uses a view of each annotated parameter, whose gradient
    (as the module computes it, before vescale reduces it) must have the annotated placements."""
    swapped = []
    for e in notes:
        param = mod._parameters.get(e.tensor)
        if not isinstance(param, DTensor) or not param.requires_grad:
            continue
        view = param.view_as(param)
        name = f"{path}.{e.tensor}" if path else e.tensor

        def check(grad: torch.Tensor, e: Entry = e, name: str = name) -> torch.Tensor:
            have = tuple(grad.placements) if isinstance(grad, DTensor) else None
            if have is None or not all(agrees(w, h) for w, h in zip(e.targets, have)):
                raise PlanError(
                    f"the gradient of {name!r} is {_fmt(have) if have else 'a plain tensor'} but plan statement(s) "
                    f"#{', #'.join(map(str, e.statements))} annotate it as {_fmt(e.targets)}; fix or drop the annotation"
                )
            return grad

        view.register_hook(check)
        mod._parameters[e.tensor] = view
        swapped.append((e.tensor, param))
    call_state(mod).grad_checked = swapped


def enable_implicit_replication() -> None:
    """Plain tensors meet DTensors as Replicate: position ids, masks and rotary tables made inside
    forward, labels next to sharded logits in a loss outside the model. This is vescale's contract (a
    plain tensor is the global tensor, the same on every rank) and DTensor's implicit replication.
    The flag is thread-local, and autograd runs backward with the thread-local state captured when
    ``backward()`` is called, so it must be on in the thread that drives training, not only inside
    forward."""
    if torch._C._get_dtensor_allow_implicit_replication():
        return  # on already (by vescale, recorded then, or by the user): nothing to change or record
    PATCHES.set_flag("parallel.implicit_replication", "DTensor implicit replication",
                     torch._C._get_dtensor_allow_implicit_replication, torch._C._set_dtensor_allow_implicit_replication, True)


def root_hooks(
    root: nn.Module, scheduler: GatherScheduler | None = None, contract: InputContract | None = None,
    reducer: GradReducer | None = None, step_check: StepCheck | None = None,
) -> list:
    """Hooks on the root module: implicit replication for whichever thread runs forward, and Partial
    outputs (a loss reduced over a sharded batch) resolved to Replicate, so that ``loss.item()`` and
    ``loss.backward()`` mean what they mean on one device. With a ZeRO-3 gather scheduler, they also
    mark the start and end of each forward (the unit order it prefetches by). ``contract`` (an
    ``InputContract``) checks the root's inputs before the plan splits them. A failed forward is
    reported to the other ranks, and ``step_check`` (a ``StepCheck``) compares the ranks' progress at
    the start of every forward call (``FaultReporter``; its pre-hook runs first, before any collective)."""

    def pre_hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        enable_implicit_replication()
        next_forward()
        if contract is not None:
            contract(args, kwargs)
        if scheduler is not None:
            scheduler.begin_forward()

    def post_hook(mod: nn.Module, args: tuple, output: Any) -> Any:
        if scheduler is not None:
            scheduler.end_forward()
        return _map_tensors(_resolve_partial, output)

    faults = FaultReporter(root, check=step_check, reducer=reducer)
    return [
        root.register_forward_pre_hook(faults.pre_hook, with_kwargs=True),
        root.register_forward_pre_hook(pre_hook, with_kwargs=True),
        root.register_forward_hook(post_hook),
        root.register_forward_hook(faults.hook, always_call=True),
    ]


def _resolve_partial(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor) and any(p.is_partial() for p in t.placements):
        whole = tuple(Replicate() if p.is_partial() else p for p in t.placements)
        if moves_nothing(t.device_mesh, t.placements, whole):  # averaged over a DP of 1, say
            return relabel(t, whole)
        return t.redistribute(t.device_mesh, whole)
    return t
