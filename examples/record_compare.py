"""Record two runs of a small model with vescale.debug.record and find where they part.

    python examples/record_compare.py single runs/single                     # one device
    torchrun --standalone --nproc-per-node 2 examples/record_compare.py tp runs/tp
    python -m vescale.debug.compare runs/single runs/tp                      # exit 0: they agree
    torchrun --standalone --nproc-per-node 2 examples/record_compare.py tp runs/tp_seed1 --seed 1
    python -m vescale.debug.compare runs/single runs/tp_seed1                # exit 1: names layers.0

The model has dropout inside each MLP; the single-device run draws it through
``vescale.random.consistent()``, so with the same seed both runs draw the same numbers.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

import vescale
import vescale.debug
import vescale.random
from vescale import Replicate, Shard, VescalePlan


class MLP(nn.Module):
    def __init__(self, dim=8, hidden=32):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(F.dropout(torch.relu(self.up(x)), p=0.1, training=self.training))


class Net(nn.Module):
    def __init__(self, dim=8, layers=2):
        super().__init__()
        self.layers = nn.ModuleList(MLP(dim) for _ in range(layers))
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["single", "tp"])
    parser.add_argument("record_dir")
    parser.add_argument("--seed", type=int, default=0, help="vescale's seed (dropout)")
    args = parser.parse_args()

    torch.manual_seed(0)  # the same initial weights in every run
    model = Net()
    vescale.manual_seed(args.seed)
    if args.mode == "tp":
        mesh = vescale.init_mesh((2,), ("TP",))
        plan = VescalePlan()
        plan.shard(r"layers\.\d+\.up\.(weight|bias)", Shard(0), mesh="TP")
        plan.shard(r"layers\.\d+\.down\.weight", Shard(1), mesh="TP")
        plan.shard(r"layers\.\d+\.<out>", Replicate(), mesh="TP")
        model = vescale.parallelize(model, plan, mesh)
    rng = vescale.random.consistent() if args.mode == "single" else contextlib.nullcontext()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(0)
    with rng, vescale.debug.record(model, args.record_dir, steps=2, overwrite=True):
        for _ in range(3):  # only the first 2 steps are recorded
            x, y = torch.randn(8, 8, generator=data), torch.randn(8, 1, generator=data)
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()


if __name__ == "__main__":
    main()
