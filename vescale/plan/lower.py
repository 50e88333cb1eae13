"""Lowering: resolve a VescalePlan against a model and a mesh into Plan IR.

Every regex is matched (full match) against the model's real tensor paths; every placement is checked
against the tensor it targets and the mesh. Problems are reported here, before any hook exists, with
the offending statement quoted and — for paths that match nothing — the closest real paths.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
from typing import Iterable

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Shard
from vescale._torch import _is_shard_like

from ..placement import InterleavedShard, interleave_of, is_interleaved, nest_zero_shards
from .api import Phase, Statement, VescalePlan, placement_str
from .ir import PlanError, PlanIR, RawEntry, optimize, ordered

__all__ = ["lower", "forward_arg_names", "KeyPattern"]


def forward_arg_names(module: nn.Module) -> tuple[list[str], bool, bool]:
    """Names of ``module.forward``'s parameters in order, and whether it takes ``*args`` / ``**kwargs``."""
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return [], True, True
    kinds = inspect.Parameter
    params = sig.parameters.values()
    names = [p.name for p in params if p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)]
    varargs = any(p.kind is kinds.VAR_POSITIONAL for p in params)
    varkw = any(p.kind is kinds.VAR_KEYWORD for p in params)
    return names, varargs, varkw


def runs_forward(module: nn.Module) -> bool:
    """Containers (ModuleList, ModuleDict) are never called, so hooks on them would never run."""
    return type(module).forward is not nn.Module.forward


def activation_path(module_path: str, direction: str) -> str:
    return f"{module_path}.<{direction}>" if module_path else f"<{direction}>"


def _closest(path: str, candidates: Iterable[str]) -> str:
    # Compare against a de-regexed path: users mostly escape dots and use \d+ for layer indices.
    plain = re.sub(r"\\d\+|\\d\*|\[0-9\][+*]", "0", path).replace("\\.", ".").replace(".*", "")
    close = difflib.get_close_matches(plain, list(candidates), n=3, cutoff=0.4)
    return f"; closest real paths: {', '.join(close)}" if close else ""


def _mesh_dims(st: Statement, mesh: DeviceMesh) -> list[tuple[int, Placement]]:
    """(mesh dim index, placement) pairs a statement sets."""
    names = tuple(mesh.mesh_dim_names or ())
    if st.mesh_dim is not None:
        if st.mesh_dim not in names:
            raise PlanError(
                f"{st}: mesh dimension {st.mesh_dim!r} does not exist; this mesh has dimensions {names}"
            )
        return [(names.index(st.mesh_dim), st.placements[0])]
    if len(st.placements) != mesh.ndim:
        raise PlanError(
            f"{st}: gives {len(st.placements)} placement(s) for a {mesh.ndim}-D mesh {names}; "
            f"name the mesh dimension (mesh='{names[-1] if names else 'TP'}') or give one placement per dimension"
        )
    return list(enumerate(st.placements))


def _check_fits(st: Statement, placement: Placement, name: str, shape) -> Placement:
    """A Shard dim must exist in the tensor; parameters cannot be Partial; an InterleavedShard's
    sections must be equal."""
    ndim = len(shape)
    if isinstance(placement, Partial):
        raise PlanError(f"{st}: {name!r} is a parameter/buffer and cannot be Partial; use Shard or Replicate")
    if is_interleaved(placement):
        k, dim = interleave_of(placement), placement.dim
        if not -ndim <= dim < ndim:
            raise PlanError(
                f"{st}: {placement!r} does not fit {name!r}, which has {ndim} dimension(s); use a dim in [0, {ndim})"
            )
        dim = dim + ndim if dim < 0 else dim
        if shape[dim] % k:
            raise PlanError(
                f"{st}: {name!r} has size {shape[dim]} on dim {dim}, which does not split into {k} equal "
                f"sections; InterleavedShard(dim, interleave) needs interleave to divide that size"
            )
        return InterleavedShard(dim, k)
    if isinstance(placement, Shard):
        if not -ndim <= placement.dim < ndim:
            raise PlanError(
                f"{st}: Shard({placement.dim}) does not fit {name!r}, which has {ndim} dimension(s); "
                f"use a dim in [0, {ndim})"
            )
        if placement.dim < 0:
            return Shard(placement.dim + ndim)
    return placement


class KeyPattern(str):
    """An input key that is a regular expression over keyword names a ``**kwargs`` forward may get:
    resolved against the keywords of each call (the first call must match at least one)."""


_NAME = re.compile(r"\w+")


def _activation_keys(st: Statement, module_path: str, module: nn.Module, key: str | None) -> list:
    """The keys a statement's ``<in>[key]`` / ``<out>[key]`` names, normalised so that one tensor has
    one key: ``<out>`` is ``<out>[0]`` (the output, or its first element), and ``<in>``, ``<in>[0]``
    and ``<in>[hidden_states]`` name one input (by its argument name where the signature knows it).
    A non-numeric key is a full-match regular expression, like the rest of the path:
    ``<in>[(input_ids|labels)]`` names both arguments."""
    direction, _ = st.activation
    key = "0" if key is None else key
    where = f"module {module_path or '<root>'!r} ({type(module).__name__}.forward)"
    if key.startswith("-"):
        raise PlanError(f"{st}: negative positions are ambiguous; use a position >= 0 or the argument name")
    if direction == "out":
        return [int(key) if key.isdigit() else key]
    names, varargs, varkw = forward_arg_names(module)
    if key.isdigit():
        i = int(key)
        if i < len(names):
            return [names[i]]
        if varargs:
            return [i]
        if not names and varkw:
            raise PlanError(f"{st}: {where} takes only **kwargs; name the input, e.g. <in>[input_ids]")
        raise PlanError(f"{st}: {where} has only {len(names)} input(s) {names}; <in>[{i}] does not exist")
    matched = [n for n in names if re.fullmatch(key, n)]
    if matched:
        return matched
    if varkw:  # a keyword only **kwargs can take: checked against the first call's keywords
        return [key if _NAME.fullmatch(key) else KeyPattern(key)]
    raise PlanError(f"{st}: {where} has no argument matching {key!r}; its arguments are {names}")


def lower(plan: VescalePlan, model: nn.Module, mesh: DeviceMesh) -> PlanIR:
    """Resolve ``plan`` against ``model`` and ``mesh`` and return the optimised Plan IR."""
    if not isinstance(plan, VescalePlan):
        raise TypeError(f"expected a vescale.VescalePlan, got {type(plan).__name__}")
    if not isinstance(mesh, DeviceMesh) or not mesh.mesh_dim_names:
        raise TypeError("mesh must be a DeviceMesh with named dimensions; build it with vescale.init_mesh(shape, names)")
    modules = dict(model.named_modules(remove_duplicate=False))
    tensors = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    is_param = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    all_paths = list(tensors) + [activation_path(m, "in") for m, mod in modules.items() if runs_forward(mod)]

    raw: list[RawEntry] = []
    planned_buffers: set[str] = set()
    for st in plan.statements:
        if st.kind in ("eager", "experts", "batch_local"):  # resolved by vescale.static / vescale.parallel
            continue
        dims = _mesh_dims(st, mesh)
        if st.kind == "factory" or st.activation:
            raw += _lower_module_statement(st, modules, dims, all_paths)
            continue
        if st.grad_of is not None:
            raw += _lower_grad_annotation(st, tensors, is_param, dims)
            continue
        pattern = re.compile(st.path)
        matched = [n for n in tensors if pattern.fullmatch(n)]
        if not matched:
            raise PlanError(f"{st}: path matches no parameter or buffer{_closest(st.path, all_paths)}")
        phases = [st.phase] if st.phase else [Phase.INIT, Phase.RUN]
        for name in matched:
            if name not in is_param:
                planned_buffers.add(name)
            module, _, tensor = name.rpartition(".")
            for d, p in dims:
                p = _check_fits(st, p, name, tuple(tensors[name].shape))
                raw += [RawEntry(module, "param", tensor, None, d, p, ph, st) for ph in phases]

    _check_interleaved_alone(raw)
    raw = _canonicalize_shared(model, raw)
    names = [n for n, _ in model.named_parameters()] + sorted(planned_buffers)
    order = {m: i for i, m in enumerate(modules)}
    ir = optimize(raw, names, order, tuple(mesh.mesh_dim_names))
    ir.mesh_dim_sizes = tuple(mesh.shape)
    _nest_zero_shards(ir, tensors, tuple(mesh.shape))
    _gather_at_every_use(ir, model, modules, order)
    return ir


def _nest_zero_shards(ir: PlanIR, tensors: dict, mesh_shape: tuple) -> None:
    """Lay every ZeRO-3 (INIT-only) shard out inside its tensor-parallel shard (FSDP2's layout, see
    ``vescale.placement.nested``), so that RUN gathers and gradient reduce-scatters run over the ZeRO
    mesh dim alone. Rewrites each gathered parameter's INIT placements, in its distribute entry and
    in its gather's sources alike."""
    param_entry = {(e.module, e.tensor): e for e in ir.entries if e.hook == "param"}
    for g in ir.entries:
        if g.action != "gather":
            continue
        name = f"{g.module}.{g.tensor}" if g.module else g.tensor
        nested = nest_zero_shards(g.sources, g.targets, tuple(tensors[name].shape), mesh_shape)
        if nested != g.sources:
            g.sources = param_entry[(g.module, g.tensor)].targets = nested


def _gather_at_every_use(ir: PlanIR, model: nn.Module, modules: dict, order: dict) -> None:
    """A shared (tied) parameter with a RUN-phase gather (ZeRO-3) is gathered before each module
    that holds it runs, not only the one its entries are kept under: ``wte`` and ``lm_head`` of a
    tied GPT-2 each get the gather entry. At run time the uses share one gathered copy per forward
    where they can (``vescale.parallel.zero``), so the gradient contributions are summed before
    the one reduce-scatter."""
    gathers = {(e.module, e.tensor): e for e in ir.entries if e.action == "gather" and e.hook == "forward_pre"}
    if not gathers:
        return
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    added = []
    for names in names_of.values():
        first = names[0].rpartition(".")
        g = gathers.get((first[0], first[2]))
        if g is None or len(names) == 1:
            continue
        for alias in names[1:]:
            module, _, tensor = alias.rpartition(".")
            if runs_forward(modules[module]) and (module, tensor) not in gathers:
                added.append(dataclasses.replace(g, module=module, tensor=tensor))
    if added:
        ir.entries = ordered(ir.entries + added, order)


def _check_interleaved_alone(raw: list[RawEntry]) -> None:
    """A tensor dim that is InterleavedShard on one mesh dim cannot be sharded on another too: its
    shards would not be sections of sections (DTensor cannot gather such a layout either)."""
    by_tensor: dict = {}
    for e in raw:
        if e.hook == "param" and _is_shard_like(e.placement):
            by_tensor.setdefault((e.module, e.tensor, e.phase, e.placement.dim), []).append(e)
    for (module, tensor, phase, dim), entries in by_tensor.items():
        if len({e.mesh_dim for e in entries}) > 1 and any(is_interleaved(e.placement) for e in entries):
            a, b = entries[0], next(e for e in entries if e.mesh_dim != entries[0].mesh_dim)
            raise PlanError(
                f"{a.statement} and {b.statement} both shard dim {dim} of {module + '.' if module else ''}{tensor} "
                f"({phase.value}); an InterleavedShard dim cannot be sharded on a second mesh dimension. "
                "Shard another dim there (e.g. Shard(1) for ZeRO-3 of a fused q|k|v Linear weight)"
            )


def _lower_grad_annotation(st: Statement, tensors: dict, is_param: set, dims) -> list[RawEntry]:
    """``plan.annotate("<parameter>.grad", ...)``: one raw "grad" entry per matched parameter and mesh dim."""
    pattern = re.compile(st.grad_of)
    matched = [n for n in tensors if n in is_param and pattern.fullmatch(n)]
    if not matched:
        raise PlanError(f"{st}: {st.grad_of!r} matches no parameter{_closest(st.grad_of, sorted(is_param))}")
    out = []
    for name in matched:
        module, _, tensor = name.rpartition(".")
        for d, p in dims:
            if _is_shard_like(p) and not -tensors[name].ndim <= p.dim < tensors[name].ndim:
                raise PlanError(f"{st}: {placement_str(p)} does not fit the gradient of {name!r}, which has {tensors[name].ndim} dimension(s)")
            out.append(RawEntry(module, "grad", tensor, None, d, p, None, st))
    return out


def _with_statement_extras(st: Statement, j: int, entry: RawEntry) -> RawEntry:
    """A redistribute statement's source and gradient placements for its ``j``-th mesh dim."""
    extras = {f: getattr(st, f)[j] for f in ("source", "grad_src", "grad_dst") if getattr(st, f)}
    return dataclasses.replace(entry, **extras) if extras else entry


def _lower_module_statement(st, modules, dims, all_paths) -> list[RawEntry]:
    """Activation and factory statements: one raw entry per matched (running) module and mesh dim."""
    pattern = re.compile(st.module_pattern)
    if st.kind == "factory":
        def candidate(m: str) -> str: return m
        suggestions = [m for m, mod in modules.items() if runs_forward(mod)]
    else:
        direction = st.activation[0]
        def candidate(m: str) -> str: return activation_path(m, direction)
        suggestions = all_paths
    matched = [m for m in modules if pattern.fullmatch(candidate(m))]
    running = [m for m in matched if runs_forward(modules[m])]
    if matched and not running:
        kinds = sorted({type(modules[m]).__name__ for m in matched})
        raise PlanError(
            f"{st}: matches only {', '.join(kinds)} container(s) {matched[:3]}, which are never called, so "
            "nothing would be placed; name the modules inside, e.g. a layer of the list"
        )
    if not running:
        raise PlanError(f"{st}: no module path matches{_closest(st.path, suggestions)}")
    out = []
    for m in running:
        if st.kind == "factory":
            hook, tensor, key = "factory", "<factory>", None
        else:
            direction, key = st.activation
            hook = "forward_pre" if direction == "in" else "forward"
            tensor = f"<{direction}>"
            for k in _activation_keys(st, m, modules[m], key):
                out += [_with_statement_extras(st, j, RawEntry(m, hook, tensor, k, d, p, None, st)) for j, (d, p) in enumerate(dims)]
            continue
        out += [RawEntry(m, hook, tensor, key, d, p, None, st) for d, p in dims]
    return out


def _canonicalize_shared(model: nn.Module, raw: list[RawEntry]) -> list[RawEntry]:
    """A parameter shared by several modules (tied weights) is one tensor: its names must get the
    same statements, and its entries are kept under its first name (its RUN-phase gathers are
    given to every name afterwards: ``_gather_at_every_use``)."""
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    canonical = {n: names[0] for names in names_of.values() if len(names) > 1 for n in names}
    if not canonical:
        return raw
    seen: dict[str, set] = {}
    for e in raw:
        if e.hook == "param" and e.name in canonical:
            seen.setdefault(e.name, set()).add((e.mesh_dim, e.phase, e.placement))
    for names in names_of.values():
        plans = [frozenset(seen.get(n, ())) for n in names]
        if len(set(plans)) > 1:
            raise PlanError(
                f"parameters {names} are one shared (tied) tensor but the plan places them differently; "
                "give every name of a shared parameter the same statements"
            )
    out = []
    for e in raw:
        if e.hook == "param" and e.name in canonical and canonical[e.name] != e.name:
            module, _, tensor = canonical[e.name].rpartition(".")
            e = dataclasses.replace(e, module=module, tensor=tensor)
        out.append(e)
    return list(dict.fromkeys(out))
