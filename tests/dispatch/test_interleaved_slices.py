"""Slices of an ``InterleavedShard`` dim at its section boundaries run on the local shards.

Issue 27, defect 4: HF's Phi-3 plans ``qkv_proj`` ``InterleavedShard(0, 3)`` (docs/plan.md) but takes
q, k and v with ``qkv[..., :pos]`` slices; DTensor's slice rule gathers a sharded dim, so attention
ran replicated on every TP rank with matching losses. Reduced: ``nn.Linear(8, 24)``, weight
``InterleavedShard(0, 3)`` on TP=2: ``chunk`` / ``split`` stayed local, ``x[..., :8]`` and
``narrow(-1, 8, 8)`` gathered.

On 2 gloo ranks (and a DP=2 x TP=2 mesh on 4): each section-aligned slice (one or several sections,
from the start or the end, ``narrow``, basic indexing) gives ``Shard`` (one section) or
``InterleavedShard`` (several) with this rank's local shape, issues no collective forward or
backward (the gradient arrives laid out like the slice), and its values and the weight's gradient
equal the single device's within 1e-6 (the slices themselves copy; the linear before them runs on
a batch split by DP, whose fp32 products and the weight gradient's sum over the batch may round in
another order). A slice that cuts a section,
or steps, still gathers (DTensor's rule).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import vescale
from vescale.debug import CollectiveCounter
from vescale.parallel.hooks import enable_implicit_replication
from vescale.placement import InterleavedShard
from vescale.testing import run_on_ranks

pytestmark = pytest.mark.multiproc

# name -> (the slice, its placement on TP (None: gathered), local width on TP=2)
SLICES = {
    "x[..., :8]": (lambda t: t[..., :8], Shard(2), 4),
    "x[..., 8:16]": (lambda t: t[..., 8:16], Shard(2), 4),
    "x[..., 16:]": (lambda t: t[..., 16:], Shard(2), 4),
    "x[..., 8:]": (lambda t: t[..., 8:], InterleavedShard(2, 2), 8),
    "x[..., -8:]": (lambda t: t[..., -8:], Shard(2), 4),
    "x[:, :, -16:-8]": (lambda t: t[:, :, -16:-8], Shard(2), 4),
    "narrow(-1, 8, 8)": (lambda t: t.narrow(-1, 8, 8), Shard(2), 4),
    "narrow(2, 0, 16)": (lambda t: torch.narrow(t, 2, 0, 16), InterleavedShard(2, 2), 8),
    "chunk(3, -1)[1]": (lambda t: t.chunk(3, -1)[1], Shard(2), 4),
    "x[..., 4:12]": (lambda t: t[..., 4:12], None, 8),
    "x[..., 0:16:2]": (lambda t: t[..., 0:16:2], None, 8),
}


def _slices(mesh_shape: tuple, names: tuple):
    mesh = vescale.init_mesh(mesh_shape, names)
    vescale.dispatch.install()
    enable_implicit_replication()  # chunk's backward cats the unused sections' zeros (plain tensors)
    tp = names.index("TP")
    torch.manual_seed(0)
    linear, x = nn.Linear(8, 24), torch.randn(2, 3, 8)
    weight = [Replicate()] * len(mesh_shape)
    weight[tp] = InterleavedShard(0, 3)
    w = distribute_tensor(linear.weight.detach(), mesh, weight).requires_grad_(True)
    batch = [Replicate()] * len(mesh_shape)
    if "DP" in names:
        batch[names.index("DP")] = Shard(0)
    dx = distribute_tensor(x, mesh, batch)
    found = {}
    for name, (cut, _, _) in SLICES.items():
        ref_w = linear.weight.detach().clone().requires_grad_(True)
        ref = cut(x @ ref_w.T)
        ref.backward(ref * 2)
        w.grad = None
        qkv = dx @ w.T  # laid out InterleavedShard(2, 3) on TP
        qkv.retain_grad()
        with CollectiveCounter() as forward:
            out = cut(qkv)
        grad = out.detach() * 2  # arrives laid out like the slice
        with CollectiveCounter() as backward:
            out.backward(grad)  # the matmul's backward on the interleaved weight is local too
        found[name] = {
            "placement": out.placements[tp], "qkv": qkv.placements[tp], "local": tuple(out.to_local().shape),
            "forward": dict(forward.counts), "backward": dict(backward.counts),
            "values": (out.full_tensor() - ref.detach()).abs().max().item(),
            "grad": (w.grad.full_tensor() - ref_w.grad).abs().max().item(),
            "grad_placement": qkv.grad.placements[tp],
        }
    return found


@pytest.mark.parametrize("mesh_shape,names", [((2,), ("TP",)), ((2, 2), ("DP", "TP"))])
def test_section_aligned_slices_stay_local(mesh_shape, names):
    world = 1
    for n in mesh_shape:
        world *= n
    found = run_on_ranks(_slices, world, mesh_shape, names)[0]
    batch = 1 if "DP" in names else 2
    for name, (_, placement, width) in SLICES.items():
        case = found[name]
        assert case["qkv"] == InterleavedShard(2, 3), case
        assert case["values"] <= 1e-6 and case["grad"] <= 1e-6, f"{name}: {case}"
        if placement is None:  # not whole sections: gathered, as DTensor's rule does
            assert case["placement"] == Replicate() and case["forward"].get("all_gather", 0) >= 1, f"{name}: {case}"
            continue
        assert case["placement"] == placement, f"{name}: {case}"
        assert case["local"] == (batch, 3, width), f"{name}: {case}"
        assert case["forward"] == {}, f"{name} communicated in forward: {case}"
        if name.startswith("chunk"):
            continue  # the other sections' zero gradients are plain tensors: DTensor's cat gathers (split's rule)
        assert case["backward"] == {}, f"{name} communicated in backward: {case}"
        assert case["grad_placement"] == InterleavedShard(2, 3), f"{name}: {case}"
