"""Expert parallelism around an unchanged MoE experts module (``plan.experts(path, mesh="EP")``).

An *experts module* is what HF's MoE models (Mixtral, Qwen3-MoE, and every model decorated with
``transformers.integrations.use_experts_implementation``) call with ``(hidden_states, top_k_index,
top_k_weights)`` — tokens (T, H), each token's K chosen expert ids and routing weights — and which
returns (T, H): the weighted sum of the chosen experts' outputs. Its parameters are stacked by
expert along dim 0 and it reads the expert count from ``num_experts``. Whatever kernel computes it
(``eager``, ``batched_mm``, ``grouped_mm``), the contract is the same, so expert parallelism can be
put around the module without touching its code:

* parameters: ``Shard(0)`` over the EP mesh dim — EP rank r holds experts [r E/EP, (r+1) E/EP);
* forward pre-hook: this rank's tokens (the batch is split over EP, and over DP if planned) are
  repeated once per chosen expert, sorted by the rank owning that expert and sent there with one
  all-to-all (the routing weights travel with them); each rank then calls the module's own forward
  on the (token, expert) pairs it received — with expert ids made local, ``num_experts`` set to its
  E/EP, and its parameters swapped for their local shards;
* forward post-hook: the results go back with the reverse all-to-all, are put back in token order
  and summed over each token's K experts.

The all-to-alls are PyTorch's autograd-aware functional collectives, so backward sends gradients
the reverse way; expert gradients stay ``Shard(0)`` on EP and are ``Partial`` over other mesh dims
that split the tokens (DP), where vescale's gradient reduction sums them. A rank that receives no
tokens still runs the forward on an empty batch, joins every all-to-all (no hang) and gives its
experts a zero gradient, as a single device gives unused experts.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
from vescale._torch import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..plan.ir import PlanError
from ..plan.lower import forward_arg_names

if TYPE_CHECKING:
    from ..plan import VescalePlan

__all__ = ["install_expert_parallel"]

_INPUTS = ("hidden_states", "top_k_index", "top_k_weights")


def install_expert_parallel(model: nn.Module, plan: VescalePlan, mesh: DeviceMesh) -> list:
    """Hooks for every ``plan.experts`` statement; returns the handles."""
    handles = []
    modules = dict(model.named_modules())
    for st in plan.statements:
        if st.kind != "experts":
            continue
        names = tuple(mesh.mesh_dim_names or ())
        if st.mesh_dim not in names:
            raise PlanError(f"{st}: mesh dimension {st.mesh_dim!r} does not exist; this mesh has dimensions {names}")
        pattern = re.compile(st.path)
        matched = [p for p in modules if pattern.fullmatch(p)]
        if not matched:
            raise PlanError(f"{st}: no module path matches")
        for path in matched:
            _check_experts_module(st, path, modules[path], mesh.size(names.index(st.mesh_dim)))
            handles += _ExpertParallel(modules[path], path, mesh, names.index(st.mesh_dim)).install()
    return handles


def _check_experts_module(st, path: str, module: nn.Module, ep: int) -> None:
    """Refuse, with the reason, a module that does not follow the experts contract."""
    n = getattr(module, "num_experts", None)
    args = forward_arg_names(module)[0]
    if not isinstance(n, int) or args[:3] != list(_INPUTS):
        raise PlanError(
            f"{st}: module {path!r} ({type(module).__name__}) is not an experts module: expert parallelism "
            f"needs an int `num_experts` and forward(hidden_states, top_k_index, top_k_weights) (HF's "
            f"experts modules); it has num_experts={n!r} and forward{tuple(args)}"
        )
    if n % ep:
        raise PlanError(f"{st}: {path!r} has {n} experts, not divisible by the EP size {ep}; use an EP size dividing {n}")
    for name, p in module.named_parameters(recurse=False):
        if p.ndim == 0 or p.shape[0] != n:
            raise PlanError(f"{st}: {path}.{name} has shape {tuple(p.shape)}; expert tensors must have the {n} experts in dim 0")


class _ExpertParallel:
    """The hooks of one experts module (see the module docstring)."""

    def __init__(self, module: nn.Module, path: str, mesh: DeviceMesh, ep_dim: int):
        self.module, self.path, self.mesh, self.ep_dim = module, path, mesh, ep_dim
        self.ep = mesh.size(ep_dim)
        self.group = mesh.get_group(ep_dim)
        self.calls: list[dict] = []  # state of the forward calls in flight (innermost last)

    def install(self) -> list:
        return [
            self.module.register_forward_pre_hook(self.pre_hook, with_kwargs=True),
            self.module.register_forward_hook(self.post_hook, with_kwargs=True, always_call=True),
        ]

    # -- layouts ----------------------------------------------------------------------------

    def _token_placements(self, t) -> tuple:
        """Tokens split over EP (dim 0); other mesh dims keep a Shard(0) split, Partial is reduced."""
        current = t.placements if isinstance(t, DTensor) else (Replicate(),) * self.mesh.ndim
        out = []
        for m, p in enumerate(current):
            if m == self.ep_dim or (isinstance(p, Shard) and p.dim == 0):
                out.append(Shard(0))
            else:
                out.append(Replicate())
        return tuple(out)

    def _local_tokens(self, t: torch.Tensor, placements) -> torch.Tensor:
        if not isinstance(t, DTensor):
            t = DTensor.from_local(t, self.mesh, (Replicate(),) * self.mesh.ndim, run_check=False)
        if tuple(t.placements) != placements:
            t = t.redistribute(self.mesh, placements)
        return t.to_local()  # autograd-aware: gradients come back laid out like the tokens

    def _local_param(self, name: str, p: torch.Tensor, token_placements) -> torch.Tensor:
        if not isinstance(p, DTensor):
            raise PlanError(f"{self.path}.{name}: expert parallelism needs DTensor parameters (parallelize the model)")
        grads = []
        for m, (pp, tp) in enumerate(zip(p.placements, token_placements)):
            if m == self.ep_dim:
                if pp != Shard(0):
                    raise PlanError(f"{self.path}.{name}: expected Shard(0) on the EP mesh dim, found {pp}")
                grads.append(Shard(0))
            elif not isinstance(pp, Replicate):
                raise PlanError(
                    f"{self.path}.{name} is {pp} on mesh dim {self.mesh.mesh_dim_names[m]!r} while its experts are "
                    "expert-parallel; keep expert tensors replicated on other mesh dims while they run "
                    "(tensor-parallel experts and EP on one module are not supported)"
                )
            else:
                # Tokens split over this dim (DP): each rank's gradient is a partial sum over its tokens.
                grads.append(Partial() if isinstance(tp, Shard) else Replicate())
        return p.to_local(grad_placements=grads)

    # -- hooks ------------------------------------------------------------------------------

    def pre_hook(self, mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        values, names = dict(kwargs), forward_arg_names(mod)[0]
        values.update(zip(names, args))
        missing = [n for n in _INPUTS if n not in values]
        if missing:
            raise TypeError(f"{self.path}: expert parallelism needs the inputs {_INPUTS}; missing {missing}")
        hidden = values["hidden_states"]
        placements = self._token_placements(hidden)
        x, ids, w = (self._local_tokens(values[n], placements) for n in _INPUTS)
        num_experts = mod.num_experts
        per_rank = num_experts // self.ep
        k = ids.shape[-1]
        flat_ids = ids.reshape(-1)
        owner = torch.div(flat_ids, per_rank, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)  # (token, choice) pairs grouped by owning rank
        send = torch.bincount(owner, minlength=self.ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        # Tokens and routing weights travel in one all-to-all (in their promoted dtype, which both
        # convert to and back exactly): one collective each way in forward and in backward, whose
        # order across ranks the data dependencies fix.
        dtype = torch.promote_types(x.dtype, w.dtype)
        pairs = torch.cat([x[torch.div(order, k, rounding_mode="floor")].to(dtype), w.reshape(-1, 1)[order].to(dtype)], 1)
        got = wait_tensor(all_to_all_single_autograd(pairs, recv_sizes, send_sizes, self.group))
        got_x, got_w = got[:, :-1].to(x.dtype), got[:, -1:].to(w.dtype)
        pairs_ids = flat_ids[order] - owner[order] * per_rank  # local expert ids on the owning rank
        got_ids = torch.empty(sum(recv_sizes), dtype=pairs_ids.dtype, device=pairs_ids.device)
        dist.all_to_all_single(got_ids, pairs_ids, recv_sizes, send_sizes, group=self.group)

        saved = dict(mod._parameters)
        local = {n: self._local_param(n, p, placements) for n, p in saved.items() if p is not None}
        mod._parameters.update(local)
        mod.num_experts = per_rank  # kernels size their one-hot / histogram by it
        self.calls.append(dict(
            saved=saved, num_experts=num_experts, local=local, order=order, k=k, send=send_sizes, recv=recv_sizes,
            hidden=hidden, placements=placements, tokens=x.shape[0], got=got,
        ))
        new_args = (got_x, got_ids.unsqueeze(-1), got_w)
        rest = {n: v for n, v in values.items() if n not in _INPUTS}
        return new_args, rest

    def post_hook(self, mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not self.calls:
            return output
        call = self.calls.pop()
        for name, local in call["local"].items():  # always: the module gets its parameters back ...
            if mod._parameters.get(name) is local:  # ... unless a ZeRO-3 hook that ran first already did
                mod._parameters[name] = call["saved"][name]
        mod.num_experts = call["num_experts"]
        if output is None or not isinstance(output, torch.Tensor):
            return output
        if output.shape[0] == 0:
            # No tokens came here, so a kernel may not have used its inputs or parameters at all. Tie
            # them into the graph: backward then runs this rank's side of the input all-to-all (the
            # other ranks wait for it) and gives the local experts a zero gradient, as every rank
            # must reduce the same gradients.
            tied = call["got"].sum() + sum(p.sum() for p in call["local"].values())
            output = output + (tied * 0).to(output.dtype)
        back = wait_tensor(all_to_all_single_autograd(output, call["send"], call["recv"], self.group))
        inverse = torch.argsort(call["order"])
        per_token = back[inverse].view(call["tokens"], call["k"], -1).sum(dim=1)
        hidden = call["hidden"]
        per_token = per_token.to(hidden.dtype)
        shape = hidden.shape[:-1] + per_token.shape[-1:]
        return DTensor.from_local(
            per_token, self.mesh, call["placements"], run_check=False, shape=shape,
            stride=torch.empty(shape, device="meta").stride(),
        )
