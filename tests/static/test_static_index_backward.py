"""A row gather ``x[idx]`` feeding tensor-parallel layers runs static, backward included.

In backward, autograd's gradient of the gather (``IndexBackward0``) accumulates the TP-partial
gradient of the rows into zeros it makes itself (``index_put(zeros, idx, grad, accumulate=True)``).
DTensor's rule takes those zeros Replicate -> Partial(sum) first: each rank's share is zeros / 2,
zeros bit for bit, so the local op is the DTensor op's local part and the module may run static
(the MoE experts' token gather under TP is this case). On 2 gloo ranks (TP=2), 4 SGD steps:

* ``gather``: the module gathering rows runs static (not kept eager), its column-parallel weight is
  a local tensor inside forward, and losses and last gradients match eager mode and the single
  device within 1e-6 (fp32: the row-parallel matmul sums in another order);
* ``ones``: the same rows gathered by a custom autograd function whose backward accumulates into
  *ones* (made the same way): Replicate -> Partial halves them on each rank, so the local op would
  count them twice; the module stays eager (only autograd's own gather of zeros qualifies) and the
  results still match.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

import vescale
from vescale.testing import run_on_ranks, sgd_steps
from vescale.model_state import state_of

STEPS, TOL = 4, 1e-6


class _RowsIntoOnes(torch.autograd.Function):
    """``x[idx]`` whose backward accumulates the gradient into ones instead of autograd's zeros."""

    @staticmethod
    def forward(ctx, x, idx):
        ctx.save_for_backward(idx)
        ctx.rows = x.shape
        return x[idx]

    @staticmethod
    def backward(ctx, grad):
        (idx,) = ctx.saved_tensors
        return torch.index_put(grad.new_ones(ctx.rows), (idx,), grad, accumulate=True), None


class Block(nn.Module):
    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.up = nn.Linear(8, 16, bias=False)  # column-parallel
        self.down = nn.Linear(16, 8, bias=False)  # row-parallel: a Partial output

    def forward(self, x, idx):
        rows = x[idx] if self.variant == "gather" else _RowsIntoOnes.apply(x, idx)
        return self.down(torch.relu(self.up(rows)))


class Net(nn.Module):
    def __init__(self, variant: str):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.block = Block(variant)

    def forward(self, x, idx):
        return self.block(self.inp(x), idx).square().sum()


def _batches():
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(6, 8, generator=g), torch.randint(0, 6, (10,), generator=g)) for _ in range(STEPS)]


def _net(variant: str) -> Net:
    torch.manual_seed(0)
    return Net(variant)


def _train(model) -> dict:
    return sgd_steps(model, _batches(), lr=0.01)


def _distributed():
    mesh = vescale.init_mesh((2,), ("TP",))
    out = {}
    for variant in ("gather", "ones"):
        for mode in ("eager", "static"):
            model = _net(variant)
            plan = vescale.VescalePlan()
            plan.shard(r"block\.up\.weight", Shard(0), mesh="TP")
            plan.shard(r"block\.down\.weight", Shard(1), mesh="TP")
            plan.shard(r"block\.<out>", Replicate(), mesh="TP")
            vescale.parallelize(model, plan, mesh, mode=mode)
            seen = []
            model.block.up.register_forward_pre_hook(lambda m, a: seen.append((type(m.weight).__name__, tuple(m.weight.shape))))
            run = _train(model)
            if mode == "static":
                rt = state_of(model).static
                run["eager_modules"] = set(vescale.static.eager_modules(model))
                run["static_steps"] = rt.static_steps
                run["up_weight"] = seen[-1]
            out[(variant, mode)] = run
    return out


@pytest.mark.multiproc
def test_autograds_gather_of_a_partial_gradient_runs_static_and_a_gather_into_ones_does_not():
    runs = run_on_ranks(_distributed, 2)
    for variant in ("gather", "ones"):
        ref = _train(_net(variant))
        for rank, results in enumerate(runs):
            eager, static = results[(variant, "eager")], results[(variant, "static")]
            what = f"{variant}, rank {rank}"
            if variant == "gather":
                assert "block" not in static["eager_modules"], (what, static["eager_modules"])
                # the block's body ran on local tensors: this rank's rows of up's (16, 8) weight
                assert static["up_weight"] == ("Tensor", (8, 8)), what
            else:
                assert "block" in static["eager_modules"], (what, static["eager_modules"])
            assert static["static_steps"] >= STEPS - 2, (what, static["static_steps"])
            for step, (a, b, c) in enumerate(zip(static["losses"], eager["losses"], ref["losses"])):
                assert abs(a - b) <= TOL * abs(c) and abs(a - c) <= TOL * abs(c), (what, step, a, b, c)
            for name, want in ref["grads"].items():
                for mode, run in (("static", static), ("eager", eager)):
                    diff = (run["grads"][name] - want).abs().max().item()
                    assert diff <= TOL * max(1.0, want.abs().max().item()), (what, mode, name, diff)
