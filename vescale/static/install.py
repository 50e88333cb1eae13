"""Installing the Static Eager hooks on every module of a parallelised model.

Each module gets one forward pre-hook and one forward hook (``ModuleHooks``); the hooks it had
before (the plan's, which work on DTensors) run inside them. Order matters: the runtime's ``enter``
runs before the plan's pre-hooks (local inputs become DTensors for the plan), ``inside`` after them
(a static module's body gets local inputs and parameters); on the way out ``leave`` runs before the
plan's forward hooks, ``handed_back`` after them, and ``restore`` last; it always runs, even when
forward raised.
"""

from __future__ import annotations

import re
from typing import Any

import torch.nn as nn

from ..plan import PlanIR, VescalePlan
from ..parallel.zero import GatherScheduler, unit_of
from ..plan.lower import runs_forward
from ..random.checkpointing import listen_to_regions
from .runtime import StaticRuntime, resolve_eager_paths
from vescale._torch import ForwardErrors, run_post_hooks, run_pre_hooks, take_forward_hooks
from vescale.model_state import state_of

__all__ = ["install_static", "static_runtime", "ModuleHooks"]


def static_runtime(model: nn.Module) -> StaticRuntime:
    rt = state_of(model).static
    if rt is None:
        raise ValueError("this model was not parallelized with mode='static'")
    return rt


def install_static(model: nn.Module, plan: VescalePlan, ir: PlanIR, plan_hooks: frozenset = frozenset(),
                   scheduler: GatherScheduler | None = None,
                   gathered_modules: dict | None = None, batch_local: dict | None = None) -> list:
    """Create the runtime (``state_of(model).static``) and install its hooks; returns the handles.
    ``plan_hooks``: the ids of the hooks parallelize installed before (the plan's and the root's);
    ``scheduler`` (ZeRO-3's GatherScheduler) and ``gathered_modules`` (path -> (gather entries, plan
    hook ids) of modules whose plan hooks only gather): the ZeRO-3 units static steps run as one;
    ``batch_local``: path -> ``vescale.parallel.batch_local.Scope`` of each batch-local module."""
    hooks = ir.hooks()
    # Modules whose plan hooks place inputs / outputs. A pre-hook that only gathers ZeRO-3
    # parameters moves no activation: wrapping there would only add a gradient reduction per
    # module (each Linear's Partial input gradient reduced on its own, not summed first).
    planned_pre = {m for (m, h), entries in hooks.items() if h == "forward_pre" and any(e.action == "redist" for e in entries)}
    planned_post = {m for (m, h), entries in hooks.items() if h == "forward" and any(e.action == "redist" for e in entries)}
    # A batch-local module's hooks move its inputs and outputs between meshes (DTensors in, DTensors
    # out); an experts module's expert-parallel hooks send its tokens to the experts' ranks and back
    # (DTensors in, DTensors out: vescale.parallel.experts).
    batch_local = dict(batch_local or {})
    placing = set(batch_local) | _experts_paths(plan, model)
    planned_pre, planned_post = planned_pre | placing, planned_post | placing
    annotated = tuple({m for (m, h), entries in hooks.items() if h == hook and any(e.action == "annotate" for e in entries)}
                      for hook in ("forward_pre", "forward"))
    # Tensors made by planned factories are DTensors: the module that makes them stays eager.
    eager = resolve_eager_paths([s for s in plan.statements if s.kind == "eager"], model)
    eager |= {m for (m, h) in hooks if h == "factory"}
    where = {"forward_pre": "in", "forward": "out"}
    grad_dst_spots = {(m, where[h], e.key): e.grad_targets for (m, h), entries in hooks.items() if h in where for e in entries if e.grad_targets}
    rt = StaticRuntime(model, eager, planned_pre, planned_post, annotated, grad_dst_spots, batch_local)
    state_of(model).static = rt
    listen_to_regions(rt)  # checkpointed regions recompute from their forward's state (recompute.py)
    handles = []
    for path, mod in model.named_modules():
        if runs_forward(mod):
            own = rt.own_hooks[path] = ModuleHooks(rt, mod, path)
            handles += own.handles
    root = rt.own_hooks.get("")
    # The root's inputs and outputs move as precompiled moves only while the plan's are its only
    # hooks (a batch-local root moves its inputs between meshes; mixed precision casts them).
    if root is not None and "" not in batch_local and root.inner.ids <= plan_hooks:
        rt.root_hooks = root.ids
    if scheduler is not None:
        _find_units(rt, model, scheduler, gathered_modules or {})
    return handles


def _experts_paths(plan: VescalePlan, model: nn.Module) -> set[str]:
    """The modules a ``plan.experts`` statement makes expert-parallel."""
    patterns = [re.compile(s.path) for s in plan.statements if s.kind == "experts"]
    return {p for p, _ in model.named_modules() if any(r.fullmatch(p) for r in patterns)} if patterns else set()


def _find_units(rt: StaticRuntime, model: nn.Module, scheduler: GatherScheduler, gathered_modules: dict) -> None:
    """The ZeRO-3 units with members (modules below the unit's whose plan hooks only gather
    parameters, not buffers): their module's hooks run StaticRuntime.unit_in / unit_out."""
    units = rt.units
    units.scheduler = scheduler
    modules = dict(model.named_modules())
    for path, (entries, ids) in gathered_modules.items():
        unit = unit_of(path)
        if unit and unit != path and unit in rt.own_hooks and all(e.tensor in modules[path]._parameters for e in entries):
            units.members.setdefault(unit, {})[path] = (entries, ids)
            units.unit_of[path] = unit
    for unit in units.members:
        rt.own_hooks[unit].unit = True


class ModuleHooks:
    """Static Eager's one forward pre-hook and one forward hook on a module.

    The hooks the module had when Static Eager was installed (the plan's placements and gathers, the
    batch-local scope's, mixed precision's casts) are taken off it and run inside these two, in their
    order, between the runtime's steps::

        pre:  [root: begin_step] enter -> the module's hooks -> inside -> [unit: unit_in]
        post: leave -> the module's hooks -> handed_back -> restore [root: end_forward] [unit: unit_out]

    The post-hook is always called, as nn.Module calls ``always_call`` hooks when forward raised:
    then only the module's always-called hooks and the runtime's clean-up run. A quiet module
    (``quiet.QuietModules.silence``) loses both hooks for the step; a quiet ZeRO-3 unit keeps them, and
    they do only the unit's gathers (``quiet``)."""

    def __init__(self, rt: StaticRuntime, mod: nn.Module, path: str):
        self.rt, self.module, self.path = rt, mod, path
        self.inner = take_forward_hooks(mod)
        self.is_root = path == ""
        self.unit = False  # a ZeRO-3 unit whose members it gathers for (install_static)
        self.quiet = False
        self.errors = ForwardErrors()  # what forward raised, for the always-called post-hook
        self.handles = [mod.register_forward_pre_hook(self.pre, with_kwargs=True),
                        mod.register_forward_hook(self.post, with_kwargs=True, always_call=True)]
        self.ids = frozenset(h.id for h in self.handles)

    def pre(self, mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        rt, path = self.rt, self.path
        self.errors.begin()
        if not self.quiet:
            if self.is_root:
                rt.begin_step(args, kwargs)
            args, kwargs = rt.enter(mod, path, args, kwargs) or (args, kwargs)
            args, kwargs = run_pre_hooks(mod, self.inner.pre, args, kwargs)
            args, kwargs = rt.inside(mod, path, args, kwargs) or (args, kwargs)
        if self.unit:
            rt.unit_in(path)
        return args, kwargs

    def post(self, mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        error = self.errors.error()
        try:
            if not self.quiet:
                output = self._post(mod, args, kwargs, output, error is not None)
        except BaseException as e:
            error = e
            raise
        finally:
            self._end(mod, output, error)
        return output

    def _post(self, mod: nn.Module, args: tuple, kwargs: dict, output: Any, raised: bool) -> Any:
        rt, path = self.rt, self.path
        if not raised:
            try:
                left = rt.leave(mod, path, output)
            except BaseException:
                run_post_hooks(mod, self.inner.post, args, kwargs, output, raised=True)
                raise
            output = left if left is not None else output
        output = run_post_hooks(mod, self.inner.post, args, kwargs, output, raised)
        if raised:
            return output
        back = rt.handed_back(mod, path, output)
        return back if back is not None else output

    def _end(self, mod: nn.Module, output: Any, error: BaseException | None) -> None:
        """The runtime's clean-up, every part of it even if one raises."""
        rt = self.rt
        try:
            if not self.quiet:
                rt.restore(mod, self.path)
                if self.is_root:
                    rt.end_forward(error)
        finally:
            if self.unit:
                rt.unit_out(self.path, output, error is not None)
