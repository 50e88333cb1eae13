"""parallelize(): apply a plan to an unchanged model, in place.

Steps: lower the plan to IR and optimise it (every error surfaces here, before anything changes);
check that every rank holds the same initial weights; turn every parameter into a DTensor parameter
with its INIT placements (planned buffers too); install the IR's hooks; attach gradient reduction.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from .. import random as vescale_random
from ..comm.grad import DEFAULT_BUCKET_MB, GradReducer, attach_grad_reduction
from ..comm.groups import prepare_groups
from .. import dispatch
from ..init import has_meta, materialize
from ..mesh import adopt_mesh, apply_run_timeout
from ..plan import PlanError, PlanIR, VescalePlan, lower
from ..plan.lower import forward_arg_names
from .contract import InputContract, checksum
from .faults import StepCheck, note_peer_failures, stamp_group
from .hooks import enable_implicit_replication, gather_only, install_module_hooks, root_hooks
from .batch_local import install_batch_local
from .experts import install_expert_parallel
from .zero import GatherScheduler
from .placing import place
from .state import attach_state_dict_hooks
from ..precision import MixedPrecision, PolicyHooks
from vescale.model_state import state_of

__all__ = ["parallelize", "explain"]


def explain(model: nn.Module, plan: VescalePlan, mesh: DeviceMesh) -> PlanIR:
    """The lowered and optimised Plan IR for ``plan`` on ``model`` and ``mesh`` (printable).
    Changes nothing; raises the same errors ``parallelize`` would. Printing it ends with a report
    per mesh dim: the parameters the plan leaves replicated there and whether it places any
    activation there (``ir.coverage()`` has the full lists, ``ir.idle_mesh_dims()`` the dims it
    does nothing on)."""
    return lower(plan, model, mesh)


def _check_same_weights(model: nn.Module, mesh: DeviceMesh) -> None:
    """Every rank must start from the single-device weights; if one rank built the model with another
    seed, training would silently diverge from the single-device run."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    named = [(n, t) for n, t in [*model.named_parameters(), *model.named_buffers()] if not t.is_meta]
    device = mesh.device_type
    # Agree on the number of tensors first: a collective over different lengths would hang.
    count = torch.tensor([len(named), -len(named)], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    if count[0].item() != -count[1].item():
        raise RuntimeError(
            f"ranks built different models ({len(named)} parameters and buffers on rank {dist.get_rank()}, "
            f"{count[0].item()} on another); build the same model on every rank"
        )
    local = checksum([t.cpu() for _, t in named])
    if local.numel() == 0:
        return
    hi, lo = local.to(device), local.to(device).neg()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MAX)
    differ = (hi.cpu() != -lo.cpu()).view(-1, 2).any(dim=1)
    if differ.any():
        bad = [n for (n, _), d in zip(named, differ.tolist()) if d][:5]
        raise RuntimeError(
            f"model weights differ across ranks (e.g. {bad}); build the model after seeding every rank "
            "identically (vescale.manual_seed(seed) or torch.manual_seed(seed)) so that all ranks start "
            "from the single-device weights"
        )


def _init_placements(ir: PlanIR) -> dict:
    return {(e.module, e.tensor): e.targets for e in ir.entries if e.hook == "param"}


def _distribute_tensors(model: nn.Module, ir: PlanIR, mesh: DeviceMesh) -> None:
    """Parameters (all of them) and planned buffers become DTensors in their INIT placements."""
    modules = dict(model.named_modules(remove_duplicate=False))
    placements = _init_placements(ir)
    done: dict[int, nn.Parameter] = {}
    for mpath, mod in modules.items():
        for name, p in list(mod._parameters.items()):
            if p is None or isinstance(p, DTensor):
                continue
            if id(p) not in done:  # a shared (tied) parameter is distributed once
                target = placements.get((mpath, name), (Replicate(),) * mesh.ndim)
                dt = place(p.data, mesh, target, f"{mpath}.{name}")  # Replicate -> Shard: a local slice
                done[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
            mod._parameters[name] = done[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None and (mpath, name) in placements and not isinstance(b, DTensor):
                mod._buffers[name] = place(b, mesh, placements[(mpath, name)], f"{mpath}.{name}")


def parallelize(
    model: nn.Module,
    plan: VescalePlan,
    mesh: DeviceMesh,
    mode: str = "eager",
    *,
    bucket_mb: float | None = DEFAULT_BUCKET_MB,
    fuse_dims: bool = True,
    prefetch: bool = True,
    check_inputs: str = "auto",
    check_steps: bool = True,
    strict: bool = False,
    mixed_precision: MixedPrecision | None = None,
) -> nn.Module:
    """Parallelise ``model`` in place according to ``plan`` on ``mesh`` and return it.

    After this call, parameters are DTensor parameters (use ``model.parameters()`` with any stock
    torch.optim optimiser), forward inputs/outputs are redistributed as planned, tensors made inside
    forward meet DTensors as Replicate (or as ``plan.factory`` says), and gradients arrive reduced to
    their parameters' placements. Plain tensors are taken as global tensors from here on in this
    thread (DTensor implicit replication), so a loss computed outside the model works unchanged.

    ``mode="static"`` (Static Eager): after one eager step per set of input shapes, modules run on
    their local shards with no DTensor dispatch; see ``vescale.static``. Same results as eager.

    Gradient communication (``vescale.comm``): gradients are reduced in buckets of ``bucket_mb``
    MiB, one collective per bucket, overlapped with backward and finished when ``backward()``
    returns; a gradient Partial on several mesh dims is reduced once over their flattened sub-mesh
    (``fuse_dims=False``: all-reduces go one dim at a time, for comparison). ZeRO-3 gathers one unit
    (a block of a ModuleList, or everything outside such lists) with one collective, prefetching the
    next unit in forward and in backward (``prefetch=False``: no prefetch); their gradients are
    reduce-scattered in the buckets. ``bucket_mb=None``: DTensor's per-tensor redistribution of each
    gradient and gather (the reference path). Use ``vescale.no_grad_sync(model)`` for accumulation
    micro-steps.

    Data contract (``vescale.parallel.contract``): a root input the plan shards must split evenly
    (else an error naming the input, the mesh dim and the fix), and every rank must pass the same
    global root inputs, while a root input the plan annotates is this rank's share of the batch
    (``plan.annotate("<in>[input_ids]", Shard(0), mesh="DP")``, each rank its own rows, loaded with
    ``vescale.data``): the same among ranks that differ only along other mesh dims, of one shape
    everywhere. ``check_inputs="auto"`` compares checksums on the first forward calls and whenever
    the inputs' shapes change, ``"always"`` on every call (debug mode), ``"off"`` never.

    A model built on the meta device (``with torch.device("meta"): model = Model(config)``) is
    materialised here: each rank allocates only its shards and the model's own init code
    (``init_weights()``, else every module's ``reset_parameters()``) fills them with the values one
    device would draw from vescale's RNG (``vescale.manual_seed`` first); see ``vescale.init``.

    Step check (``vescale.parallel.faults``): at the start of every forward call, before its first
    collective, the ranks compare in one small all-reduce on a gloo group of their own whether their
    previous forward raised, how many optimiser steps they have taken and a fingerprint of the
    inputs; a rank that fell behind by an optimiser step, was given another batch or raised where the
    others did not makes every rank raise ``OutOfStepError`` naming it. ``check_steps=False`` turns
    it off.

    ``mixed_precision=vescale.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``:
    modules compute with their parameters cast to ``param_dtype`` (ZeRO-3 gathers the cast shard:
    half the bytes of fp32), gradients are reduced in ``reduce_dtype``, and the parameters (fp32
    masters), ``param.grad``, optimizer state and checkpoints keep the parameters' dtype. The
    single-device reference is ``vescale.apply_mixed_precision(model, policy)``; see ``vescale.precision``.

    ``strict=True``: refuse a plan that does nothing on some mesh dim of size > 1 (no parameter
    sharded and no activation split there; see ``vescale.explain``'s report), e.g. a DP dim whose
    batch statement names no real input.
    """
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(
            f"parallelize: mixed_precision must be a vescale.MixedPrecision, got {type(mixed_precision).__name__}; "
            "e.g. vescale.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"
        )
    if state_of(model).ir is None and state_of(model).mixed_precision is not None:
        raise ValueError(
            "parallelize: the model has a policy from vescale.apply_mixed_precision (the single-device "
            "reference); build a fresh model and pass the policy as parallelize(..., mixed_precision=...)"
        )
    if mode not in ("eager", "static"):
        raise ValueError(f"parallelize: mode must be 'eager' or 'static', got {mode!r}")
    if state_of(model).ir is not None:
        raise RuntimeError("this model is already parallelized; build a fresh model to apply another plan")
    ir = lower(plan, model, mesh)
    for group in mesh.get_all_groups():  # a mesh made without init_mesh: its groups get the run's timeout
        apply_run_timeout(group)
    if strict and ir.idle_mesh_dims():
        raise PlanError(
            f"parallelize(strict=True): the plan does nothing on mesh dim(s) {ir.idle_mesh_dims()}: no parameter "
            "is sharded and no activation is split there, so every rank along them does the same work.\n"
            f"{ir.report()}\nShard the batch (plan.shard('<in>[input_ids]', Shard(0), mesh=...)) or parameters there"
        )
    adopt_mesh(mesh)  # vescale's op semantics for the model's DTensors (and only for this mesh's)
    root_inputs = [e for e in ir.hooks().get(("", "forward_pre"), []) if e.tensor == "<in>"]
    contract = InputContract(root_inputs, forward_arg_names(model)[0], mesh, check_inputs)
    try:
        _check_same_weights(model, mesh)
    except Exception as e:  # a collective no other rank joined: name what they reported
        note_peer_failures(e, "parallelize's check that every rank holds the same initial weights")
        raise
    if has_meta(model):  # built on the meta device: allocate shards, replay the model's init code
        dispatch.install()  # DTensor ops of the init code (interleaved splits, ...) as in training
        materialize(model, mesh, _init_placements(ir))
    _distribute_tensors(model, ir, mesh)

    reducer = scheduler = None
    if bucket_mb is not None:
        prepare_groups(mesh)  # collective: every rank makes the flattened groups, in one order
        reducer = GradReducer(mesh, bucket_mb, fuse_dims, mixed_precision)
        scheduler = GatherScheduler(mesh, reducer, prefetch, mixed_precision)
    enable_implicit_replication()
    # Random ops on the model's DTensors draw single-device numbers (and refuse to run, with a
    # message, until vescale.manual_seed is called) instead of the same numbers on every rank.
    vescale_random.install()
    # loss.item() of a Partial loss is the global loss; cheap sharding-propagation misses.
    dispatch.install()
    step_check = None
    if check_steps:
        group = stamp_group()  # collective the first time: every rank makes it, here
        if group is not None:
            step_check = StepCheck(group, contract.fingerprint)
    handles = root_hooks(model, scheduler, contract, reducer, step_check)
    modules = dict(model.named_modules(remove_duplicate=False))
    per_module: dict[str, dict[str, list]] = {}
    for (mpath, hook), entries in ir.hooks().items():
        per_module.setdefault(mpath, {})[hook] = entries
    gathered_modules = {}  # path -> (gather entries, hook ids) of modules whose plan hooks only gather
    for mpath, hook_entries in per_module.items():
        installed = install_module_hooks(modules[mpath], mpath, hook_entries, mesh, scheduler, mixed_precision)
        handles += installed
        gathers = gather_only(hook_entries) if scheduler is not None else None
        if gathers is not None:
            gathered_modules[mpath] = (gathers, frozenset(h.id for h in installed))
    handles += install_expert_parallel(model, plan, mesh)  # after the gathers: it sees RUN params
    local_handles, scopes = install_batch_local(model, plan, mesh)  # after the gathers too
    handles += local_handles
    handles += attach_grad_reduction(model.parameters(), reducer, mixed_precision)
    handles += attach_state_dict_hooks(model)  # DCP-describable layouts for InterleavedShard tensors
    plan_hooks = frozenset(h.id for h in handles)
    policy_hooks = None if mixed_precision is None else PolicyHooks(model, mixed_precision)
    if policy_hooks is not None:  # after the plan's hooks: the casts see what they left (ZeRO-3 copies)
        handles += policy_hooks.install_casts()
    if mode == "static":
        from ..static import install_static

        handles += install_static(model, plan, ir, plan_hooks, scheduler, gathered_modules, scopes)
    if policy_hooks is not None:  # last: the masters go back after every other hook is done
        handles += policy_hooks.install_restores()

    state = state_of(model)
    state.ir, state.mesh, state.handles, state.reducer = ir, mesh, handles, reducer
    state.step_check, state.gathers, state.mixed_precision = step_check, scheduler, mixed_precision
    return model
