"""Experts that get no tokens, and expert-parallel errors.

HF's experts module (``MixtralExperts``, unchanged) is driven directly with routings chosen by the
test: every token goes to experts 0 and 1, which EP rank 0 owns, so EP rank 1 receives no token at
all (it must still join the all-to-alls — no hang — and give its experts a zero gradient), and
under TP / DP + ZeRO-3 experts 2 and 3 are unused. Outputs and gradients (experts and routing
weights) must match the single-device module within 1e-6 (fp32, sums in another order), and the
unused experts' gradients must be exactly zero, as on one device.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import vescale
from vescale import InterleavedShard, Replicate, Shard, VescalePlan
from vescale.testing import run_on_ranks

transformers = pytest.importorskip("transformers")
from transformers.models.mixtral.modeling_mixtral import MixtralExperts  # noqa: E402

TOKENS, HIDDEN, INTER, EXPERTS = 6, 16, 32, 4
TOL = 1e-6


class Routed(nn.Module):
    """The experts module with a fixed routing (top-2 among experts 0 and 1) and trainable weights."""

    def __init__(self, kernel: str):
        super().__init__()
        config = transformers.MixtralConfig(
            hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS, experts_implementation=kernel
        )
        config._experts_implementation = kernel
        self.experts = MixtralExperts(config)
        for p in self.experts.parameters():
            nn.init.normal_(p, std=0.1)
        self.routing = nn.Parameter(torch.rand(TOKENS, 2))

    def forward(self, x):
        index = torch.tensor([[0, 1], [1, 0]] * (TOKENS // 2))
        return self.experts(x, index, self.routing.softmax(-1))


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(TOKENS, HIDDEN, generator=g), torch.randn(TOKENS, HIDDEN, generator=g)


def _run(model, mesh=None):
    x, target = _inputs()
    out = model(x)
    loss = (out * target).sum()
    loss.backward()
    value = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t).detach()  # noqa: E731
    return value(out), {n: value(p.grad) for n, p in model.named_parameters()}


@functools.cache
def _single(kernel: str):
    torch.manual_seed(0)
    return _run(Routed(kernel))


def _plan(kind: str) -> VescalePlan:
    plan = VescalePlan()
    if kind == "EP=2":
        plan.experts(r"experts", mesh="EP")
        plan.shard(r"<in>", Shard(0), mesh="EP")
    elif kind == "TP=2":
        plan.shard(r"experts\.gate_up_proj", InterleavedShard(1, 2), mesh="TP")
        plan.shard(r"experts\.down_proj", Shard(2), mesh="TP")
        plan.shard(r"experts\.<out>", Replicate(), mesh="TP")
    else:  # DP=2 + ZeRO-3 of the experts
        plan.shard(r"<in>", Shard(0), mesh="DP")
        plan.shard(r"experts\.(gate_up|down)_proj", Shard(0), mesh="DP", phase=vescale.INIT)
        plan.shard(r"experts\.(gate_up|down)_proj", Replicate(), mesh="DP", phase=vescale.RUN)
    return plan


def _distributed(kind: str, kernel: str):
    mesh = vescale.init_mesh((2,), (kind[:2],))
    torch.manual_seed(0)
    model = vescale.parallelize(Routed(kernel), _plan(kind), mesh)
    out, grads = _run(model)
    local = {n: p.grad._local_tensor.clone() for n, p in model.experts.named_parameters()}
    return out, grads, local, mesh.get_coordinate()[0]


@pytest.mark.multiproc
@pytest.mark.parametrize("kernel", ["eager", "batched_mm", "grouped_mm"])
@pytest.mark.parametrize("kind", ["EP=2", "TP=2", "DP=2+ZeRO-3"])
def test_unused_experts_get_zero_gradient_and_nothing_hangs(kind, kernel):
    want_out, want_grads = _single(kernel)
    for name in ("experts.gate_up_proj", "experts.down_proj"):
        assert want_grads[name][2:].abs().max() == 0 and want_grads[name][:2].abs().max() > 0
    results = run_on_ranks(_distributed, 2, kind, kernel, timeout=120)
    for out, grads, local, coord in results:
        torch.testing.assert_close(out, want_out, rtol=0, atol=TOL)
        for name, want in want_grads.items():
            torch.testing.assert_close(grads[name], want, rtol=0, atol=TOL, msg=f"{kind} {kernel}: {name}")
            if name.startswith("experts.") and kind == "EP=2":
                # rank 1 owns experts 2 and 3, received no token, and still has a (zero) gradient
                assert local[name.split(".")[1]].shape[0] == EXPERTS // 2
                assert (local[name.split(".")[1]].abs().max() == 0) == (coord == 1)


def _bad_plans(case: str):
    # Both ranks must be connected before either can fail fast (a lowering error needs no
    # collective) and tear its process group down under the other's start-up.
    dist.barrier()
    mesh = vescale.init_mesh((2,), ("EP",))
    torch.manual_seed(0)
    model = Routed("eager")
    plan = VescalePlan()
    if case == "not experts":
        model = nn.Sequential(nn.Linear(4, 4))
        plan.experts(r"0", mesh="EP")
    elif case == "mesh":
        plan.experts(r"experts", mesh="XP")
    try:
        vescale.parallelize(model, plan, mesh)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.multiproc
def test_expert_parallel_errors_name_the_module_and_fix():
    errors = run_on_ranks(_bad_plans, 2, "not experts")[0]
    assert errors and "is not an experts module" in errors and "forward(hidden_states, top_k_index, top_k_weights)" in errors
    errors = run_on_ranks(_bad_plans, 2, "mesh")[0]
    assert errors and "mesh dimension 'XP' does not exist" in errors
