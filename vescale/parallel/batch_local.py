"""Modules that compute on this rank's share of the batch only (``plan.batch_local(path, mesh="DP")``).

A per-token module (an MoE block: router, top-k, experts) gives each token a result that depends on
that token alone, so under data parallelism each DP rank can run it on its own tokens. DTensor
cannot say so: on the (DP, TP) mesh the block's input is ``Shard(0)`` on DP, and DTensor's rules for
the routing's data-dependent ops (``topk``/``one_hot``/``nonzero``/``index_add``/``_grouped_mm``)
replicate such a tensor first, so every DP rank would run the experts on every DP rank's tokens.

Around each matched module (the *scope*) this module puts hooks that take the DP dim away while it
runs and give it back afterwards, with DTensor and DeviceMesh only:

* inputs: a DTensor on the full mesh that is ``Shard(dim)`` on DP becomes a DTensor on the sub-mesh
  of the other dims (``mesh["TP"]``; a plain local tensor when DP is the only dim) holding this DP
  rank's tokens, its global shape this rank's share; ``Replicate`` on DP stays whole. The other
  dims' placements are kept, so TP inside the scope is unchanged;
* parameters of the scope and of every module inside it, each time its module runs (after the
  plan's ZeRO-3 gathers): viewed on the sub-mesh; they must be ``Replicate`` on DP while they run
  (the RUN phase of ZeRO-3). Their gradients go back as ``Partial`` over DP — each rank's sum over
  its own tokens — which vescale.comm's DP / ZeRO-3 gradient reduction sums, as for any DP gradient;
* outputs: back to the full mesh, ``Shard(dim)`` on DP (every output of the scope holds its rank's
  tokens along ``dim``), their gradients split the same way.

Each conversion is one autograd node that re-labels the local tensor (no copy, no collective) and,
in backward, re-labels the gradient: whatever placements it has on the sub-mesh are kept, DP's is
added or dropped. Random ops in the scope would draw numbers for the rank's share as if it were
the whole tensor (not the single-device numbers vescale.random guarantees), so the first forward
call in each of train / eval mode watches the scope's ops and refuses a random one, naming the
module and the fix.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from vescale._torch import DTensorSpec, TensorMeta, TorchDispatchMode

from ..dispatch.metas import contiguous_strides
from ..plan.api import Statement
from ..plan.ir import PlanError
from ..plan.lower import runs_forward
from .hooks import _map_tensors

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

    from ..plan import VescalePlan

__all__ = ["install_batch_local", "batch_local_paths", "Scope"]


def batch_local_paths(plan: VescalePlan, model: nn.Module) -> dict[str, Statement]:
    """Module path -> its ``plan.batch_local`` statement (each statement must match a module that runs)."""
    modules = [p for p, m in model.named_modules() if runs_forward(m)]
    found: dict[str, Statement] = {}
    for st in plan.statements:
        if st.kind != "batch_local":
            continue
        hits = [p for p in modules if re.fullmatch(st.path, p)]
        if not hits:
            raise PlanError(f"{st}: matches no module that runs forward")
        for p in hits:
            found.setdefault(p, st)
    inner = [(a, b) for a in found for b in found if a != b and b.startswith(f"{a}.")]
    if inner:
        raise PlanError(f"{found[inner[0][1]]}: module {inner[0][1]!r} lies inside {inner[0][0]!r}, already batch-local; match only the outer one")
    return found


def install_batch_local(model: nn.Module, plan: VescalePlan, mesh: DeviceMesh) -> tuple[list, dict]:
    """Hooks for every ``plan.batch_local`` statement; returns the handles and the scopes (module
    path -> ``Scope``). Call after the plan's own hooks (the parameter views must see ZeRO-3's
    gathered copies)."""
    scopes = batch_local_paths(plan, model)
    if not scopes:
        return [], {}
    experts = [s for s in plan.statements if s.kind == "experts"]
    handles, subs, installed = [], {}, {}
    for path, st in scopes.items():
        names = tuple(mesh.mesh_dim_names or ())
        if st.mesh_dim not in names:
            raise PlanError(f"{st}: mesh dimension {st.mesh_dim!r} does not exist; this mesh has dimensions {names}")
        module = model.get_submodule(path)
        _check_inside(plan, st, path, module, experts)
        if st.mesh_dim not in subs:  # sub-meshes made once, in statement order on every rank
            rest = tuple(n for n in names if n != st.mesh_dim)
            subs[st.mesh_dim] = mesh[rest if len(rest) > 1 else rest[0]] if rest else None
        installed[path] = Scope(module, path, st, mesh, names.index(st.mesh_dim), subs[st.mesh_dim])
        handles += installed[path].install()
    return handles, installed


def _check_inside(plan, st, path: str, module: nn.Module, experts: list) -> None:
    """Refuse what cannot work inside a batch-local module: expert parallelism, and activation
    statements of the modules inside it (stated on the full mesh; their tensors live on the sub-mesh)."""
    activations = [s for s in plan.statements if s.kind in ("shard", "redistribute", "annotate") and s.activation]
    for inner, _ in module.named_modules(prefix=path):
        clash = next((e for e in experts if re.fullmatch(e.path, inner)), None)
        if clash is not None:
            raise PlanError(f"{st} and {clash}: {inner!r} cannot be both batch-local and expert-parallel; drop one")
        if inner == path:
            continue  # the module's own inputs and outputs are placed on the full mesh, outside the scope
        for a in activations:
            if any(re.fullmatch(a.module_pattern, f"{inner}.<{d}>") for d in ("in", "out")):
                raise PlanError(
                    f"{a}: module {inner!r} lies inside the batch-local {path!r} ({st}), where tensors live on the "
                    f"sub-mesh without {st.mesh_dim!r}; state placements of the batch-local module's own inputs and outputs instead"
                )


# ---------------------------------------------------------------------------------------------
# Re-labelling one tensor between the full mesh and the sub-mesh
# ---------------------------------------------------------------------------------------------


def _without(placements, i: int) -> tuple:
    return tuple(p for j, p in enumerate(placements) if j != i)


def _with(placements: Sequence[Placement], i: int, p: Placement) -> tuple:
    out = list(placements)
    out.insert(i, p)
    return tuple(out)


def _dtensor(local: torch.Tensor, mesh: DeviceMesh, placements: tuple, shape, stride) -> DTensor:
    spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    return DTensor(local.view_as(local), spec, requires_grad=local.requires_grad)


def _local(t) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class _ToSub(torch.autograd.Function):
    """Full-mesh DTensor -> this DP rank's share on the sub-mesh (a plain tensor if there is none).
    Backward: the gradient's sub-mesh placements, with ``grad_dp`` on DP."""

    @staticmethod
    def forward(
        ctx: Any, x: DTensor, sub: DeviceMesh | None, dp: int, shape: Sequence[int], grad_dp: Placement
    ) -> torch.Tensor:
        ctx.spec, ctx.dp, ctx.grad_dp = x._spec, dp, grad_dp
        ctx.set_materialize_grads(False)
        local = x._local_tensor
        if sub is None:
            return local.view_as(local)
        stride = x.stride() if tuple(shape) == tuple(x.shape) else contiguous_strides(shape)
        return _dtensor(local, sub, _without(x.placements, dp), shape, stride)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple:
        if grad is None:
            return None, None, None, None, None
        spec = ctx.spec
        sub_placements = grad.placements if isinstance(grad, DTensor) else ()
        placements = _with(sub_placements, ctx.dp, ctx.grad_dp)
        return _dtensor(_local(grad), spec.mesh, placements, spec.shape, spec.stride), None, None, None, None


class _FromSub(torch.autograd.Function):
    """This DP rank's share (sub-mesh DTensor or plain tensor) -> full-mesh DTensor, ``Shard(dim)``
    on DP. Backward: the gradient moved to ``Shard(dim)`` on DP if it is not, then DP dropped."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, mesh: DeviceMesh, dp: int, dim: int) -> DTensor:
        ctx.dp, ctx.dim, ctx.sub_spec = dp, dim, y._spec if isinstance(y, DTensor) else None
        ctx.set_materialize_grads(False)
        sub_placements = y.placements if isinstance(y, DTensor) else ()
        shape = list(y.shape)
        shape[dim] *= mesh.size(dp)  # every DP rank holds as many tokens (the batch splits evenly)
        local = _local(y)
        return _dtensor(local, mesh, _with(sub_placements, dp, Shard(dim)), shape, contiguous_strides(shape))

    @staticmethod
    def backward(ctx: Any, grad: DTensor | None) -> tuple:
        if grad is None:
            return None, None, None, None
        if grad.placements[ctx.dp] != Shard(ctx.dim):
            want = list(grad.placements)
            want[ctx.dp] = Shard(ctx.dim)
            grad = grad.redistribute(grad.device_mesh, want)
        if ctx.sub_spec is None:
            return grad._local_tensor, None, None, None
        s = ctx.sub_spec
        return _dtensor(grad._local_tensor, s.mesh, _without(grad.placements, ctx.dp), s.shape, s.stride), None, None, None


# ---------------------------------------------------------------------------------------------
# The hooks of one scope
# ---------------------------------------------------------------------------------------------


class _RandomGuard(TorchDispatchMode):
    """Refuses random ops while the scope's forward runs (see the module docstring)."""

    def __init__(self, path: str, st):
        super().__init__()
        self.path, self.st = path, st
        self.random_ops = DTensor._op_dispatcher._random_ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.random_ops:
            raise PlanError(
                f"{self.st}: module {self.path!r} draws random numbers ({func}) while batch-local: each rank would "
                f"draw them for its share of the batch as if it were the whole tensor, not the single-device "
                f"numbers; turn the randomness off in this module (e.g. Mixtral's router_jitter_noise=0) or drop "
                f"plan.batch_local for it"
            )
        return func(*args, **(kwargs or {}))


class Scope:
    """The hooks of one batch-local module and of the modules inside it.

    On local tensors every conversion here is the identity (only the DTensor labels change), so
    Static Eager steps that move the scope's inputs and outputs with precompiled relabels and give
    its parameters their full-mesh gradient layouts turn the hooks off (``bypass``) for the step."""

    def __init__(self, module: nn.Module, path: str, st, mesh: DeviceMesh, dp: int, sub):
        self.module, self.path, self.st, self.mesh, self.dp, self.sub = module, path, st, mesh, dp, sub
        self.dim = 0  # the batch dim of the scope's inputs and outputs
        self.checked: set[bool] = set()  # training modes whose first call was watched for random ops
        self.guards: list[_RandomGuard] = []
        self.bypass = False
        self.param_hooks: dict[str, frozenset] = {}  # module path -> ids of its parameter-view hooks

    def install(self) -> list:
        handles = [
            self.module.register_forward_pre_hook(self.enter, with_kwargs=True),
            # Before the plan's output placements (they are stated on the full mesh).
            self.module.register_forward_hook(self.leave, with_kwargs=True, prepend=True),
            self.module.register_forward_hook(self.close_guard, with_kwargs=True, always_call=True),
        ]
        for name, mod in self.module.named_modules(prefix=self.path):
            if any(True for _ in mod.parameters(recurse=False)):
                swapped: list = []
                views = [
                    mod.register_forward_pre_hook(lambda m, a, name=name, s=swapped: self.view_params(m, name, s)),
                    mod.register_forward_hook(lambda m, a, o, s=swapped: self.put_back(m, s), prepend=True, always_call=True),
                ]
                self.param_hooks[name] = frozenset(h.id for h in views)
                handles += views
        return handles

    # -- inputs and outputs -----------------------------------------------------------------

    def enter(self, mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.bypass:
            return None
        if mod.training not in self.checked:  # watched once per mode: models turn randomness on with train()
            self.checked.add(mod.training)
            guard = _RandomGuard(self.path, self.st)
            guard.__enter__()
            self.guards.append(guard)
        where = iter(range(1 << 30))

        def to_sub(t: torch.Tensor) -> torch.Tensor:
            return self._input(t, next(where))

        return tuple(_map_tensors(to_sub, list(args))), {k: _map_tensors(to_sub, v) for k, v in kwargs.items()}

    def _input(self, t: torch.Tensor, index: int):
        if not isinstance(t, DTensor):
            return t  # a plain tensor is the global tensor on every rank: whole here too
        if t.device_mesh != self.mesh:
            raise PlanError(f"{self.st}: input {index} of {self.path!r} lives on {t.device_mesh}, not on the plan's mesh {self.mesh}")
        p = t.placements[self.dp]
        shape = list(t.shape)
        if p == Shard(self.dim):
            shape[self.dim] = t._local_tensor.shape[self.dim] if self.sub is None else _dp_share(t, self.dp, self.dim)
            grad_dp = Shard(self.dim)
        elif isinstance(p, Replicate):
            grad_dp = Partial()  # every rank's tokens use it: each rank's gradient is a partial sum
        else:
            raise PlanError(
                f"{self.st}: input {index} of {self.path!r} is {p} on mesh dim {self.st.mesh_dim!r}; a batch-local "
                f"module takes inputs split along dim {self.dim} (Shard({self.dim})) or replicated there"
            )
        return _ToSub.apply(t, self.sub, self.dp, tuple(shape), grad_dp)

    def leave(self, mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        self.close_guard()
        return None if self.bypass else _map_tensors(self._output, output)

    def _output(self, t: torch.Tensor):
        if isinstance(t, DTensor) and t.device_mesh != self.sub:
            raise PlanError(
                f"{self.st}: {self.path!r} returns a DTensor on {t.device_mesh}; inside a batch-local module tensors "
                f"live on the sub-mesh {self.sub} (this rank's share of the batch)"
            )
        return _FromSub.apply(t, self.mesh, self.dp, self.dim)

    def close_guard(self, *_: object) -> None:
        while self.guards:
            self.guards.pop().__exit__(None, None, None)

    # -- parameters ---------------------------------------------------------------------------

    def view_params(self, mod: nn.Module, name: str, swapped: list) -> None:
        """The module's parameters (ZeRO-3's gathered copies, if any) on the sub-mesh, for this call."""
        swapped.clear()
        if self.bypass:
            return
        for pname, p in mod._parameters.items():
            if not isinstance(p, DTensor):
                continue
            if not isinstance(p.placements[self.dp], Replicate):
                raise PlanError(
                    f"{self.st}: parameter {name}.{pname} is {p.placements[self.dp]} on mesh dim {self.st.mesh_dim!r} "
                    f"while its module runs; a batch-local module needs its parameters whole there (gather them "
                    f"for the RUN phase: plan.shard(..., Replicate(), mesh={self.st.mesh_dim!r}, phase=RUN))"
                )
            swapped.append((pname, p))
        for pname, p in swapped:
            mod._parameters[pname] = _ToSub.apply(p, self.sub, self.dp, tuple(p.shape), Partial())

    def put_back(self, mod: nn.Module, swapped: list) -> None:
        for pname, p in swapped:
            mod._parameters[pname] = p
        swapped.clear()


def _dp_share(t: DTensor, dp: int, dim: int) -> int:
    """The length along ``dim`` of this DP rank's share of ``t`` (sharded along ``dim`` on DP only)."""
    if any(isinstance(q, Shard) and q.dim == dim for j, q in enumerate(t.placements) if j != dp):
        raise PlanError(f"a batch-local module's input is split along dim {dim} by another mesh dim too ({t.placements}); "
                        f"split the batch on the batch-local mesh dim only")
    mesh = t.device_mesh
    size, _ = Shard(dim)._local_shard_size_and_offset(t.shape[dim], mesh.size(dp), mesh.get_local_rank(dp))
    return size
