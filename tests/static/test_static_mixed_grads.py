"""A static body whose tensor gets gradients in different layouts from its consumers stays eager.

``block`` hands its input to two column-parallel layers: ``a``, kept eager by the plan, and ``b``,
static. Their input gradients are partial sums over TP; a static step hands ``a``'s back reduced
(to Replicate, as ``from_local`` does) while ``b``'s stays a local Partial share, and a static
``block`` would add the two as local tensors (``inp``'s weight gradient 0.24 off the single
device, silently, before the check). DTensor, recording, sums them right, so the check is on
autograd's sum itself: an ``add`` of gradients of different layouts under a boundary's node (the
eager child's mirrored wrap, a child's body-input alias) keeps the caller eager
(``_OpWatcher._mixed_sum``), in every later record too (the cause shows only while the caller is
assumed static). On 2 gloo ranks (TP=2), 4 SGD steps: ``block`` is kept eager with that reason,
``b`` still runs static, and losses and last gradients match eager mode and the single device
within 1e-6 relative (fp32: the row-parallel matmul sums in another order).

The same for a body that makes a gradient no local tensor holds (a ``sum`` over a DP-split
activation, whose DTensor backward expands the gradient replicated): ``_unlaid_gradients``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

import vescale
from vescale.testing import run_on_ranks, sgd_steps

STEPS, TOL = 4, 1e-6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16, bias=False)  # column-parallel, kept eager
        self.b = nn.Linear(8, 16, bias=False)  # column-parallel, static
        self.out = nn.Linear(16, 8, bias=False)  # row-parallel

    def forward(self, x):
        return self.out(torch.relu(self.a(x)) * self.b(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.block = Block()

    def forward(self, x):
        return self.block(self.inp(x)).square().sum()


def _batches():
    g = torch.Generator().manual_seed(4)
    return [torch.randn(6, 8, generator=g) for _ in range(STEPS)]


def _train(model) -> dict:
    return sgd_steps(model, [(x,) for x in _batches()], lr=0.01)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _distributed():
    mesh = vescale.init_mesh((2,), ("TP",))
    out = {}
    for mode in ("eager", "static"):
        model = _net()
        plan = vescale.VescalePlan()
        plan.shard(r"block\.(a|b)\.weight", Shard(0), mesh="TP")
        plan.shard(r"block\.out\.weight", Shard(1), mesh="TP")
        plan.shard(r"block\.<out>", Replicate(), mesh="TP")
        plan.eager(r"block\.a")
        vescale.parallelize(model, plan, mesh, mode=mode)
        seen = []
        model.block.b.register_forward_pre_hook(lambda m, a: seen.append((type(m.weight).__name__, tuple(m.weight.shape))))
        out[mode] = _train(model)
        if mode == "static":
            out["why"] = vescale.static.eager_modules(model)
            out["b_weight"] = seen[-1]
    return out


@pytest.mark.multiproc
def test_a_body_summing_gradients_of_different_layouts_stays_eager():
    ref = _train(_net())
    for rank, got in enumerate(run_on_ranks(_distributed, 2)):
        assert set(got["why"]) == {"block", "block.a"}, (rank, got["why"])
        assert "arrive from its consumers as" in got["why"]["block"], got["why"]
        # b still runs static inside the eager block, on this rank's rows of its (16, 8) weight
        assert got["b_weight"] == ("Tensor", (8, 8)), rank
        for mode in ("eager", "static"):
            for step, (a, b) in enumerate(zip(got[mode]["losses"], ref["losses"])):
                assert abs(a - b) <= TOL * abs(b), (rank, mode, step, a, b)
            for name, want in ref["grads"].items():
                diff = (got[mode]["grads"][name] - want).abs().max().item()
                assert diff <= TOL * max(1.0, want.abs().max().item()), (rank, mode, name, diff)


class Summing(nn.Module):
    """Sums its DP-split activation itself: DTensor's backward of that sum expands the gradient
    replicated, which the static body's local autograd cannot (it expands it to the local rows)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(6, 6)

    def forward(self, x, y):
        return self.w(y).sum() * x.sum()


class SummingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = Summing()

    def forward(self, x, y):
        return self.mix(x, y)


def _summing(mode: str) -> dict:
    mesh = vescale.init_mesh((2,), ("DP",))
    torch.manual_seed(0)
    model = SummingNet()
    plan = vescale.VescalePlan().shard(r"mix\.<in>\[y\]", Shard(0), mesh="DP")
    vescale.parallelize(model, plan, mesh, mode=mode)
    g = torch.Generator().manual_seed(5)
    out = sgd_steps(model, [(torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)) for _ in range(STEPS)], lr=0.01)
    if mode == "static":
        out["why"] = vescale.static.eager_modules(model)
        out["static_steps"] = vescale.static.static_runtime(model).static_steps
    return out


@pytest.mark.multiproc
def test_a_body_making_a_gradient_no_local_tensor_holds_stays_eager():
    """``mix`` sums ``w``'s DP-split output: DTensor hands ``w`` a replicated gradient for it, which
    a local tensor of ``w``'s output (this rank's rows) cannot be. Before the check the static step
    handed the local rows over as that gradient and DTensor failed on the shapes (a RuntimeError in
    backward); now the recording keeps ``mix`` eager, naming why, and static training is eager
    mode's bit for bit (everything that computes is eager here)."""
    eager, static = run_on_ranks(lambda: (_summing("eager"), _summing("static")), 2)[0]
    assert "is [Replicate()] on DTensors, which a local tensor laid out as [Shard(dim=0)] cannot hold" in static["why"]["mix"], static["why"]
    assert static["static_steps"] >= 1
    assert static["losses"] == eager["losses"]
    for name, g in eager["grads"].items():
        assert torch.equal(static["grads"][name], g), name
