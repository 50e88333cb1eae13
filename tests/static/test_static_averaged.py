"""A value averaged over data-parallel ranks (``Partial("avg")``) leaving static code.

A mean over a DP-sharded batch is averaged over the DP ranks: each rank's local value is the mean of
its shard, and its share of the gradient is 1/DP of the whole (``vescale.static.averaged``). On 2
gloo ranks (DP=2, batch sharded), a toy net whose ``head`` takes that mean runs 5 SGD steps in
eager and static mode against the single device:

* ``plain``: the root only returns the head's mean: head and root run static, the loss leaves the
  root averaged, and the wrap divides its gradient by 2;
* ``eager_root``: the root is kept eager by the plan: the head's output leaves static code there;
* ``consumed``: the root multiplies the mean by a parameter (an op of static code consuming an
  averaged value, whose parameter gradient the division would get wrong): the root stays eager,
  the head runs static;
* ``passed_on``: the root hands the mean to a child that scales it (the child's op consumes it): the
  child stays eager, and the root too (it gets the child's averaged output back).

Losses and last-step gradients must match the single device within 1e-6 (fp32 means over 2 ranks
sum in another order) and eager mode; the modules kept eager are exactly the expected ones; the
head's weight is a local tensor inside its forward in static steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Shard

import vescale
from vescale.testing import run_on_ranks, sgd_steps
from vescale.model_state import state_of

STEPS, TOL = 5, 1e-6


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x):
        return self.proj(x).square().mean()  # over the DP-sharded batch: Partial(avg) on DP


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(1.5))

    def forward(self, m):
        return m * self.w


class Net(nn.Module):
    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.head = Head()
        self.scale = Scale()

    def forward(self, x):
        m = self.head(x)
        if self.variant == "consumed":
            return m * self.scale.w
        if self.variant == "passed_on":
            return self.scale(m)
        return m


VARIANTS = {  # variant: modules kept eager in static mode
    "plain": set(),
    "eager_root": {""},
    "consumed": {""},
    "passed_on": {"", "scale"},
}


def _batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(8, 8, generator=g) for _ in range(STEPS)]


def _train(model) -> dict:
    return sgd_steps(model, [(x,) for x in _batches()], lr=0.1)


def _net(variant: str) -> Net:
    torch.manual_seed(0)
    return Net(variant)


def _distributed():
    mesh = vescale.init_mesh((2,), ("DP",))
    out = {}
    for variant in VARIANTS:
        for mode in ("eager", "static"):
            model = _net(variant)
            plan = vescale.VescalePlan()
            plan.shard(r"<in>\[x\]", Shard(0), mesh="DP")
            if variant == "eager_root":
                plan.eager(r"")
            vescale.parallelize(model, plan, mesh, mode=mode)
            local = []
            model.head.proj.register_forward_pre_hook(lambda m, a: local.append(type(m.weight).__name__))
            run = _train(model)
            if mode == "static":
                rt = state_of(model).static
                run["why"] = vescale.static.eager_modules(model)
                run["eager_modules"] = set(run["why"])
                run["unsafe"] = dict(rt.latest().unsafe)
                run["static_steps"] = rt.static_steps
                run["head_weight"] = local[-1]
            out[(variant, mode)] = run
    return out


@pytest.mark.multiproc
def test_averaged_partial_leaves_static_code_with_its_share_of_the_gradient():
    runs = run_on_ranks(_distributed, 2)
    for variant, eager_modules in VARIANTS.items():
        ref = _train(_net(variant))
        for rank, results in enumerate(runs):
            eager, static = results[(variant, "eager")], results[(variant, "static")]
            what = f"{variant}, rank {rank}"
            assert static["eager_modules"] == eager_modules, (what, static["unsafe"])
            # why each is eager: the plan's statement, else what the recording found
            assert static["why"] == {p: static["unsafe"].get(p, "plan.eager") for p in eager_modules}, what
            if variant == "eager_root":
                assert static["why"] == {"": "plan.eager"}, what
            assert static["static_steps"] >= STEPS - 3, (what, static["static_steps"])  # passed_on records 3 times
            assert static["head_weight"] == "Tensor", what  # the head's body ran on local tensors
            for step, (a, b, c) in enumerate(zip(static["losses"], eager["losses"], ref["losses"])):
                assert abs(a - b) <= TOL and abs(a - c) <= TOL, (what, step, a, b, c)
            for name, want in ref["grads"].items():
                for mode, run in (("static", static), ("eager", eager)):
                    diff = (run["grads"][name] - want).abs().max().item()
                    # Without the rule, static gradients are 2x the single device's.
                    assert diff <= TOL, f"{what}: {mode} gradient of {name} differs from single device by {diff:.3g}"
    consumed = runs[0][("consumed", "static")]["unsafe"][""]
    assert "averaged" in consumed, consumed
