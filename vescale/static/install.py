"""Installing the Static Eager hooks on every module of a parallelised model.

Order matters, because the plan's own hooks work on DTensors: on each module the runtime's
``enter`` runs before every other pre-hook (local inputs become DTensors for the plan), ``inside``
after them (a static module's body gets local inputs and parameters); on the way out ``leave`` runs
before every other forward hook, ``handed_back`` after them, and ``restore`` last; it always runs,
even when forward raised.
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
from vescale.model_state import state_of

__all__ = ["install_static", "static_runtime"]


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
            own = _install_one(rt, mod, path)
            rt.own_hooks[path] = (mod, frozenset(h.id for h in own))
            handles += own
    if "" not in batch_local and "" in rt.own_hooks:  # a batch-local root moves its inputs between meshes
        rt.root_hooks = plan_hooks | rt.own_hooks[""][1]
    if scheduler is not None:
        handles += _install_units(rt, model, scheduler, gathered_modules or {})
    return handles


def _experts_paths(plan: VescalePlan, model: nn.Module) -> set[str]:
    """The modules a ``plan.experts`` statement makes expert-parallel."""
    patterns = [re.compile(s.path) for s in plan.statements if s.kind == "experts"]
    return {p for p, _ in model.named_modules() if any(r.fullmatch(p) for r in patterns)} if patterns else set()


def _install_units(rt: StaticRuntime, model: nn.Module, scheduler, gathered_modules: dict) -> list:
    """The unit hooks (StaticRuntime.unit_in / unit_out) on the module of each ZeRO-3 unit with
    members: modules below it whose plan hooks only gather parameters (not buffers)."""
    rt.scheduler = scheduler
    modules = dict(model.named_modules())
    for path, (entries, ids) in gathered_modules.items():
        unit = unit_of(path)
        if unit and unit != path and unit in rt.own_hooks and all(e.tensor in modules[path]._parameters for e in entries):
            rt.unit_members.setdefault(unit, {})[path] = (entries, ids)
            rt.unit_of_member[path] = unit
    handles = []
    for unit in rt.unit_members:
        mod = modules[unit]
        own = [mod.register_forward_pre_hook(lambda m, args, unit=unit: rt.unit_in(unit)),
               mod.register_forward_hook(lambda m, args, out, unit=unit: rt.unit_out(unit, out), always_call=True)]
        rt.unit_hooks[unit] = frozenset(h.id for h in own)
        m, ids = rt.own_hooks[unit]
        rt.own_hooks[unit] = (m, ids | rt.unit_hooks[unit])
        handles += own
    return handles


def _install_one(rt: StaticRuntime, mod: nn.Module, path: str) -> list:
    is_root = path == ""

    def enter(m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if is_root:
            rt.begin_step(args, kwargs)
        return rt.enter(m, path, args, kwargs)

    def inside(m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        return rt.inside(m, path, args, kwargs)

    def leave(m: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        return rt.leave(m, path, output)

    def restore(m: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        rt.restore(m, path)
        if is_root:
            rt.end_forward()

    def handed_back(m: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        return rt.handed_back(m, path, output)

    return [
        mod.register_forward_pre_hook(enter, with_kwargs=True, prepend=True),
        mod.register_forward_pre_hook(inside, with_kwargs=True),
        mod.register_forward_hook(leave, with_kwargs=True, prepend=True),
        mod.register_forward_hook(handed_back, with_kwargs=True),
        mod.register_forward_hook(restore, with_kwargs=True, always_call=True),  # last: ends the module
    ]
