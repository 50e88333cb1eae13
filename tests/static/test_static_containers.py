"""A module that loops over a ModuleList is the caller of the list's modules.

The root below stays eager (it adds a row-parallel block's Partial output to its residual, which
needs a redistribution), its blocks run static. The blocks' outputs must reach the root as the
DTensors the recording saw: a container (ModuleList) never runs, so it cannot be the "caller" whose
static-ness decides whether an output is handed over as a local tensor. Handing the root a local
Partial sum would silently drop the other ranks' parts. Static losses must equal eager mode's bit
for bit (the same local ops on the same local values, the same collectives) and be within 1e-6 of
the single device's (fp32: the row-parallel ``down`` sums its columns in two partial sums, reduced
over TP, where one device sums them in one matmul), and the blocks must really run static (their
weights are local shards inside forward).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Shard

import vescale
from vescale.testing import run_on_ranks


class Block(nn.Module):
    def __init__(self, dim=8, hidden=16):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)  # a Partial block output meets the residual in the (eager) root
        return self.head(x)


def _train(mode: str | None):
    """Five SGD steps on TP=2 in ``mode``, or on one device (None)."""
    torch.manual_seed(0)
    model = Net()
    if mode is not None:
        mesh = vescale.init_mesh((2,), ("TP",))
        plan = vescale.VescalePlan()
        plan.shard(r"blocks\.\d+\.up\.(weight|bias)", Shard(0), mesh="TP")
        plan.shard(r"blocks\.\d+\.down\.weight", Shard(1), mesh="TP")  # output left Partial on purpose
        vescale.parallelize(model, plan, mesh, mode=mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    seen, losses = [], []
    model.blocks[0].up.register_forward_pre_hook(lambda m, a: seen.append(tuple(m.weight.shape)))
    for _ in range(5):
        x, y = torch.randn(4, 8, generator=data), torch.randn(4, 1, generator=data)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())
    return losses, seen


def _both():
    return _train("eager"), _train("static")


@pytest.mark.multiproc
def test_blocks_in_a_module_list_hand_dtensors_to_an_eager_caller():
    single, _ = _train(None)
    (eager, _), (static, seen) = run_on_ranks(_both, 2)[0]
    assert seen[-1] == (8, 8), f"the static block should see its local (8, 8) shard of up.weight, saw {seen}"
    assert static == eager, (static, eager)
    for a, b in zip(static, single):
        assert abs(a - b) <= 1e-6, (static, single)
