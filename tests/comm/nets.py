"""A small model with many small parameters and plans for DP, SP, ZeRO-3 and their meshes, shared
by the bucketing tests and benchmarks/bench_comm.py."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from vescale import INIT, RUN, VescalePlan


class Block(nn.Module):
    def __init__(self, width: int, expert: bool):
        super().__init__()
        self.norm = nn.Parameter(torch.ones(width))
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width, bias=False), nn.ReLU(), nn.Linear(2 * width, width, bias=False))
        # Never called: an unused MoE expert (no gradient, must not be reduced, must not hang).
        self.expert = nn.Linear(width, width, bias=False) if expert else None

    def forward(self, x):
        h = x * self.norm
        return x + self.mlp(h)


class Net(nn.Module):
    """(tokens, width) in, scalar loss out. ``inp``/``out`` are tied; ``frozen`` never trains."""

    def __init__(self, width: int = 8, depth: int = 3):
        super().__init__()
        self.inp = nn.Linear(width, width, bias=False)
        self.layers = nn.ModuleList(Block(width, expert=(i == 0)) for i in range(depth))
        self.frozen = nn.Parameter(torch.full((width,), 0.5), requires_grad=False)
        self.out = nn.Linear(width, width, bias=False)
        self.out.weight = self.inp.weight  # tied

    def forward(self, x):
        h = self.inp(x) * self.frozen
        for layer in self.layers:
            h = layer(h)
        return self.out(h).pow(2).mean()


def net_plan(mesh, *, tp: bool = False, dp: bool = False, zero3: bool = False) -> VescalePlan:
    """DP: tokens split on DP. SP (on TP): tokens also split on TP outside the MLPs, so every weight
    used there (norms, tied in/out) gets a Partial gradient on TP; the MLPs are Megatron TP.
    ZeRO-3 on the blocks' weights, the unused expert included (gathered with its block, no gradient)."""
    plan = VescalePlan()
    if dp:
        plan.shard("<in>", Shard(0), mesh="DP")
    if tp:
        plan.shard("<in>", Shard(0), mesh="TP")
        plan.shard(r"layers\.\d+\.mlp\.<in>", Replicate(), mesh="TP")
        plan.shard(r"layers\.\d+\.mlp\.0\.weight", Shard(0), mesh="TP")
        plan.shard(r"layers\.\d+\.mlp\.2\.weight", Shard(1), mesh="TP")
        plan.shard(r"layers\.\d+\.mlp\.<out>", Shard(0), mesh="TP")
    if zero3:
        plan.shard(r"layers\.\d+\.(mlp\.\d+\.weight|norm|expert\.weight)", Shard(0), mesh="DP", phase=INIT)
        plan.shard(r"layers\.\d+\.(mlp\.\d+\.weight|norm|expert\.weight)", Replicate(), mesh="DP", phase=RUN)
    return plan


def batch(tokens: int = 16, width: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randn(tokens, width, generator=torch.Generator().manual_seed(seed))


def build(mesh, seed: int = 0, **plan_kw):
    torch.manual_seed(seed)
    return Net(), net_plan(mesh, **plan_kw)
