"""Stop a 2-rank tensor-parallel run in pdb on rank 0 while rank 1 waits.

    torchrun --standalone --nproc-per-node 2 examples/debug_breakpoint.py

Rank 0 prints the command that attaches a terminal to its pdb (run it in a second terminal).
Try ``p y.placements``, ``p y.to_local().shape`` (rank 0's shard), ``pg y`` (the global tensor),
``pg model.up.weight.grad[:2]``, then ``c``: both ranks go on and print the same loss.
"""

import torch
import torch.nn as nn

import vescale
import vescale.debug
from vescale import Replicate, Shard, VescalePlan


class MLP(nn.Module):
    def __init__(self, dim=8, hidden=32):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


mesh = vescale.init_mesh((2,), ("TP",))
torch.manual_seed(0)
model = MLP()
plan = VescalePlan()
plan.shard(r"up\.(weight|bias)", Shard(0), mesh="TP")
plan.shard(r"down\.weight", Shard(1), mesh="TP")
plan.shard(r"<out>", Replicate(), mesh="TP")
model = vescale.parallelize(model, plan, mesh)

x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
y = model.up(x)  # column-parallel: y is sharded along its last dim
loss = model(x).pow(2).mean()
loss.backward()
vescale.debug.breakpoint(rank=0)
print(f"rank {torch.distributed.get_rank()}: loss {loss.full_tensor().item():.6f}")
