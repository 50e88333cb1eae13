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
