"""KNOWN BUG (strict xfail): a static body whose tensor gets gradients in different layouts from
its consumers computes wrong gradients upstream.

``block`` hands its input to two column-parallel layers: ``a``, kept eager by the plan, and ``b``,
static. Their input gradients are partial sums over TP; a static step hands ``a``'s back reduced
(to Replicate, as ``from_local`` does) while ``b``'s stays a local Partial share, and the static
``block`` adds the two as local tensors. DTensor, recording, sums them right (it partitions the
replicated one first), so the recording does not notice; static steps then give ``inp``'s weight
gradient 0.24 off the single device (losses 2e-3 off by the third step). What the test asks for
once fixed: ``block`` kept eager (or the gradients reconciled), ``b`` still static, losses and
gradients within 1e-6 relative of eager mode and the single device (fp32: the row-parallel matmul
sums in another order). See docs/static.md, "Limits". An attempt to catch it from the node
autograd sums under (a body input's alias) caught the MoE case but not this one: here the sum runs
under the eager child's ``from_local`` node.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import vescale
from vescale.testing import run_on_ranks

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


def _value(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(model) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses, grads = [], {}
    for step, x in enumerate(_batches()):
        loss = model(x)
        loss.backward()
        if step == STEPS - 1:
            grads = {n: _value(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(_value(loss).item())
    return {"losses": losses, "grads": grads}


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
        model.block.b.register_forward_pre_hook(lambda m, a: seen.append(type(m.weight).__name__))
        out[mode] = _train(model)
        if mode == "static":
            out["why"] = vescale.static.eager_modules(model)
            out["b_weight"] = seen[-1]
    return out


@pytest.mark.multiproc
@pytest.mark.xfail(strict=True, reason="known: static mode adds gradients of different layouts as local tensors")
def test_a_body_summing_gradients_of_different_layouts_stays_eager():
    ref = _train(_net())
    for rank, got in enumerate(run_on_ranks(_distributed, 2)):
        assert got["b_weight"] == "Tensor", rank  # b runs static
        for mode in ("eager", "static"):
            for step, (a, b) in enumerate(zip(got[mode]["losses"], ref["losses"])):
                assert abs(a - b) <= TOL * abs(b), (rank, mode, step, a, b)
            for name, want in ref["grads"].items():
                diff = (got[mode]["grads"][name] - want).abs().max().item()
                assert diff <= TOL * max(1.0, want.abs().max().item()), (rank, mode, name, diff)
