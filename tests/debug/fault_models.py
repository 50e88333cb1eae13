"""A tiny model with the seams where distributed runs go wrong, for the recorder/comparer tests.

``Scan`` and ``HeadNorm`` stand for fused kernels: they run on each rank's *local* shard (as custom
kernels do, since they take plain tensors), so they are right only for the layouts they assume —
``Scan`` needs the whole sequence, ``HeadNorm`` whole heads. ``Mix`` is dropout.

Faults the tests inject (each must be found at its own module):
* a plan that places ``scan``'s input sharded along the sequence (``WRONG_SCAN_PLACEMENT``);
* a dropout drawn with another seed on one run;
* ``HeadNorm(global_view=True)``: ``view(..., heads, -1)`` with the *global* head count, which on a
  rank holding half the heads silently splits every head in two.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from vescale import VescalePlan

DIM, HEADS, BATCH, SEQ = 8, 2, 2, 8


def on_local(kernel, x: torch.Tensor) -> torch.Tensor:
    """Run ``kernel`` on the local shard; the result keeps ``x``'s layout (what a kernel wrapper does)."""
    if isinstance(x, DTensor):
        out = kernel(x.to_local())
        return DTensor.from_local(out, x.device_mesh, x.placements, shape=x.shape, stride=x.stride())
    return kernel(x)


class Scan(nn.Module):
    """Causal running mean over the sequence (dim 1)."""

    def forward(self, x):
        def kernel(t):
            return t.cumsum(1) / torch.arange(1, t.shape[1] + 1, dtype=t.dtype).view(1, -1, 1)

        return on_local(kernel, x)


class HeadNorm(nn.Module):
    """RMS norm of every head of the last dim."""

    def __init__(self, heads: int, head_dim: int, global_view: bool = False):
        super().__init__()
        self.heads, self.head_dim, self.global_view = heads, head_dim, global_view

    def forward(self, x):
        def kernel(t):
            if self.global_view:  # the fault: the global head count
                h = t.view(*t.shape[:-1], self.heads, -1)
            else:  # right: the head count follows the tensor
                h = t.view(*t.shape[:-1], -1, self.head_dim)
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).reshape(t.shape)

        return on_local(kernel, x)


class Mix(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        return F.dropout(x, p=self.p, training=self.training)


class Block(nn.Module):
    def __init__(self, global_view: bool):
        super().__init__()
        self.q = nn.Linear(DIM, DIM, bias=False)
        self.norm = HeadNorm(HEADS, DIM // HEADS, global_view)
        self.mix = Mix(0.25)
        self.o = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        return x + self.o(self.mix(self.norm(self.q(x))))


class Net(nn.Module):
    def __init__(self, global_view: bool = False, skip_scan: bool = False):
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.scan = Scan()
        self.block = Block(global_view)
        self.head = nn.Linear(DIM, 1)
        self.skip_scan = skip_scan

    def forward(self, x, y):
        h = self.embed(x)
        if not self.skip_scan:
            h = self.scan(h)
        pred = self.head(self.block(h)).squeeze(-1)
        return ((pred - y) ** 2).mean()


def build(**kwargs) -> Net:
    torch.manual_seed(0)
    return Net(**kwargs)


def batches(steps: int = 2):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, SEQ, DIM, generator=g), torch.randn(BATCH, SEQ, generator=g)) for _ in range(steps)]


def tp_plan(wrong_scan_placement: bool = False) -> VescalePlan:
    """Tensor parallel on mesh "TP": q column-parallel (heads split), o row-parallel."""
    plan = VescalePlan()
    plan.shard(r"block\.q\.weight", Shard(0), mesh="TP")
    plan.shard(r"block\.norm\.<in>", Shard(2), mesh="TP")  # whole heads on each rank
    plan.shard(r"block\.o\.weight", Shard(1), mesh="TP")
    plan.shard(r"block\.o\.<out>", Replicate(), mesh="TP")
    # The scan needs the whole sequence; sharding its input along the sequence is the wrong plan.
    plan.shard(r"scan\.<in>", Shard(1) if wrong_scan_placement else Replicate(), mesh="TP")
    return plan


def train(model, directory: str | None, steps: int = 2, **record_kwargs) -> list[float]:
    """``steps`` SGD steps inside ``vescale.debug.record`` (not recorded when ``directory`` is None);
    returns the losses."""
    import contextlib

    import vescale.debug

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    recording = contextlib.nullcontext() if directory is None else vescale.debug.record(model, directory, steps=steps, **record_kwargs)
    with recording:
        for x, y in batches(steps):
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.full_tensor().item() if isinstance(loss, DTensor) else loss.item())
    return losses
