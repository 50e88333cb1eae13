"""Stock ``torch.optim`` steps on DTensor parameters run on their local shards.

An elementwise optimiser (SGD, Adam, AdamW, ...) updates every element from that element's own
gradient and state, so updating each rank's shard with its shard of the gradient *is* the global
update. On DTensors every one of its ~10 ops per parameter pays DTensor dispatch (30-140 µs each on
CPU), which made AdamW 10x slower than on plain tensors.

``install()`` registers PyTorch's global optimiser step pre/post hooks (at ``parallelize`` time,
never at import). For an optimiser of an elementwise class whose parameters include DTensors, the
pre-hook hands the step each DTensor parameter's local tensor (the same storage, so the update lands
in the DTensor), its gradient's local tensor, and its state's local tensors; the post-hook puts the
DTensor parameters back and keeps the state as DTensors laid out like their parameters, so
``optimizer.state_dict()``, DCP checkpoints and resharding see what they always saw. Optimisers that
are not elementwise (Adafactor, LBFGS, anything unknown), and steps whose gradients are not laid
out like their parameters, keep running on DTensors, which is correct.

Within a param group, the shards of one dtype and device are stepped as slices of flat buffers
(``vescale.optim.flat``: ~10 ops a step instead of ~10 per parameter, the same bits); what a
flat layout cannot take (fused steps, sparse or complex parameters, a dtype with one parameter,
state of another shape) gets its local tensor as above.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .flat import flat_allowed, layouts_for
from vescale._torch import PATCHES
from vescale.model_state import WeakStates

__all__ = ["install_local_optimizer_step", "uninstall_local_optimizer_step", "ELEMENTWISE_OPTIMIZERS", "given_params"]

# Optimisers whose update of an element reads only that element's parameter, gradient and state.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD,
)

_OWNER = "dispatch.fast.optim"


@dataclass
class LocalStepState:
    """What the local step keeps per optimiser (in a weak table, ``step_state(opt)``, not on it)."""

    swapped: list = field(default_factory=list)  # while a step runs: (group, its params, (param, local) pairs)
    state_dtensors: dict = field(default_factory=dict)  # local tensor -> its parameter's state as DTensors
    flat_begun: list = field(default_factory=list)  # flat layouts with runs in this step
    flat_layouts: dict = field(default_factory=dict)  # id(param group) -> (group, params, layouts, alone)


step_state = WeakStates(LocalStepState)


def _uses_local_step(opt: torch.optim.Optimizer) -> bool:
    """Elementwise class, DTensor parameters, and every gradient laid out exactly like its
    parameter: a Partial or differently sharded gradient (PyTorch's own TP leaves such gradients)
    must go through DTensor, which redistributes it; its local values are not the update's input."""
    if type(opt) not in ELEMENTWISE_OPTIMIZERS:  # subclasses may add non-elementwise logic
        return False
    params = [p for g in opt.param_groups for p in g["params"]]
    if not any(isinstance(p, DTensor) for p in params):
        return False
    return all(
        p.grad is None or (isinstance(p.grad, DTensor) and (p.grad._spec is p._spec or p.grad._spec == p._spec))
        for p in params
        if isinstance(p, DTensor)
    )


def _to_local(opt: torch.optim.Optimizer) -> None:
    swapped = []  # (group, original params, (param, local) of the per-tensor step) to restore
    as_dtensors: dict = {}  # local tensor -> its parameter's state as DTensors, reused by _to_dtensor
    begun: list = []  # flat layouts with runs in this step
    for group in opt.param_groups:
        params = group["params"]
        runs: list = []
        alone = params
        if flat_allowed(group):
            alone, runs = _flat_runs(opt, group, begun)
        pairs = [(p, _local_entry(opt, p, as_dtensors)) for p in alone]
        swapped.append((group, params, pairs))
        group["params"] = [local for _, local in pairs] + runs
    state = step_state(opt)
    state.swapped, state.state_dtensors, state.flat_begun = swapped, as_dtensors, begun


def _local_entry(opt: torch.optim.Optimizer, p: torch.Tensor, as_dtensors: dict) -> torch.Tensor:
    """The per-tensor step's stand-in for ``p``: its local tensor, with its gradient's local tensor
    and its state's local tensors."""
    if not isinstance(p, DTensor):
        return p
    local = p._local_tensor
    local.grad = None if p.grad is None else p.grad._local_tensor
    state = opt.state.pop(p, None)
    if state:
        opt.state[local] = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in state.items()}
        as_dtensors[local] = state
    return local


def _flat_runs(opt: torch.optim.Optimizer, group: dict, begun: list) -> tuple[list, list]:
    """The group's parameters left to the per-tensor step and the flat run tensors for the rest.
    Layouts are kept per group and rebuilt when its parameter list or a local shard's shape,
    dtype or device changed."""
    cache = step_state(opt).flat_layouts
    params = group["params"]
    kept = cache.get(id(group))
    for attempt in range(2):
        if attempt or kept is None or kept[0] is not group or not _same_list(kept[1], params):
            _forget_replaced_groups(opt, cache)
            kept = cache[id(group)] = (group, list(params), *layouts_for(params))
        _, _, layouts, alone = kept
        alone, mine = list(alone), []
        for layout in layouts:
            rest = layout.begin(opt)
            if rest is None:
                break
            mine.append(layout)
            alone.extend(rest)
        else:
            begun.extend(mine)
            return alone, [run for layout in mine for run in layout.run_tensors()]
        for layout in mine:
            layout.abandon(opt)
    raise AssertionError("a freshly built flat layout must fit its parameters")


def _forget_replaced_groups(opt: torch.optim.Optimizer, cache: dict) -> None:
    """Drop the layouts of param groups the optimiser no longer has (``load_state_dict`` makes new
    group dicts): their buffers would otherwise stay alive with the layout."""
    for key in [k for k, kept in cache.items() if not any(kept[0] is g for g in opt.param_groups)]:
        del cache[key]


def _same_list(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _to_dtensor(opt: torch.optim.Optimizer, finished: bool = True) -> None:
    """Put the parameters back; ``finished``: the step ran to its end (else it raised, and flat runs
    are dropped without writing their copies back)."""
    state = step_state.peek(opt)
    if state is None:  # an optimiser the local step never swapped (its pre-hook runs for every one)
        return
    begun, before, swapped = state.flat_begun, state.state_dtensors, state.swapped
    state.flat_begun, state.state_dtensors, state.swapped = [], {}, []
    for layout in begun:
        layout.finish(opt) if finished else layout.abandon(opt)
    for group, params, pairs in swapped:
        group["params"] = params
        for p, local in pairs:
            if local is p or not isinstance(p, DTensor):
                continue
            local.grad = None  # the gradient lives in p.grad; the alias would keep a second reference
            state = opt.state.pop(local, None)
            if state:
                was = before.get(local, {})
                opt.state[p] = {k: _as_param_layout(v, local, p, was.get(k)) for k, v in state.items()}


def _as_param_layout(value, local: torch.Tensor, param: DTensor, was=None):
    """Per-element state (shaped like the local shard) becomes a DTensor laid out like ``param``;
    scalars such as Adam's step count stay as they are. ``was``: the DTensor this state entry was
    before the step; the step updates state in place, so it is usually still the right wrapper."""
    if isinstance(was, DTensor) and was._local_tensor is value and was._spec is param._spec:
        return was
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == local.shape and value.ndim > 0:
        return DTensor(value, param._spec, requires_grad=False)
    return value


def _pre_hook(opt, args, kwargs):
    _to_dtensor(opt, finished=False)  # a previous step that raised left its swap behind
    if _uses_local_step(opt):
        _to_local(opt)


def _post_hook(opt, args, kwargs):
    _to_dtensor(opt)


def given_params(opt: torch.optim.Optimizer) -> list:
    """The optimiser's parameters as it was given them, also during a step that swapped their local
    tensors in (global step hooks of others may run inside that swap)."""
    state = step_state.peek(opt)
    if state is not None and state.swapped:
        return [p for _, params, _ in state.swapped for p in params]
    return [p for group in opt.param_groups for p in group["params"]]


def install_local_optimizer_step() -> None:
    """Register the global optimiser hooks (idempotent)."""
    if not PATCHES.owners(_OWNER):
        PATCHES.on_undo(_OWNER, register_optimizer_step_pre_hook(_pre_hook).remove)
        PATCHES.on_undo(_OWNER, register_optimizer_step_post_hook(_post_hook).remove)


def uninstall_local_optimizer_step() -> None:
    PATCHES.undo(_OWNER)


