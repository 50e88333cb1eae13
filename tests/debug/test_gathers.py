"""``vescale.debug.gathers``: which ops gather a sharded tensor inside the model (issue 27).

On a fake process group (sharding decisions need no communication):

* a Phi-3-like attention (q, k and v cut from one fused projection by slices) planned with a plain
  ``Shard(0)`` on the fused weight, as a plan that ignores the sections would: the report names the
  module, ``aten.slice.Tensor``, the argument, its layout and the model's source line, forward;
  planned ``InterleavedShard(0, 3)`` (docs/plan.md): no gather at all, forward or backward;
* the zoo LLaMA under ``llama_plan`` (DP=2 x TP=2, SP, ZeRO-3): in Static Eager mode no gather; in
  eager mode only the loss's ``log_softmax`` over the vocabulary-sharded logits, in the root (eager
  mode gathers the vocabulary for the loss; Static Eager runs it on the shards), nothing in any
  layer;
* ops outside any module, and what the report's lines and ``modules()`` say.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import vescale
from vescale import InterleavedShard, Replicate, Shard, VescalePlan
from vescale.debug import gathers
from vescale.testing import fake_world, forget_dtensor_caches
from vescale.zoo import llama_plan, tiny_llama


class FusedAttention(nn.Module):
    """q, k and v out of one projection, cut by slices (HF Phi-3's attention)."""

    def __init__(self, dim: int = 8, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        qkv = self.qkv(x)
        d = qkv.shape[-1] // 3
        q, k, v = qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:]
        b, s, _ = x.shape
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = FusedAttention()

    def forward(self, x):
        return self.attn(x)


def _report(qkv_placement):
    with fake_world(2):
        forget_dtensor_caches()  # decisions and moves of other fake worlds' groups
        mesh = vescale.init_mesh((2,), ("TP",), device_type="cpu")
        torch.manual_seed(0)
        model = Net()
        plan = VescalePlan()
        plan.shard(r"attn\.qkv\.(weight|bias)", qkv_placement, mesh="TP")
        plan.shard(r"attn\.out\.weight", Shard(1), mesh="TP")
        plan.shard(r"attn\.<out>", Replicate(), mesh="TP")
        vescale.parallelize(model, plan, mesh)
        with gathers(model) as report:
            model(torch.randn(2, 3, 8)).sum().backward()
        return report


def test_a_slice_that_gathers_the_fused_projection_is_named():
    report = _report(Shard(0))
    forward = [g for g in report.counts if g.phase == "forward"]
    assert {g.op for g in forward} == {"aten.slice.Tensor"}, str(report)
    assert {g.module for g in forward} == {"attn"}
    first = next(g for g in forward if "[..., :d]" in (g.where or ""))
    assert first.shape == (2, 3, 24) and first.placements == (Shard(2),) and first.mesh_dims == ("TP",)
    assert first.where.startswith("test_gathers.py:") and "q, k, v = qkv[..., :d]" in first.where
    assert sum(report.counts[g] for g in forward) == 3  # q, k and v
    assert report.modules()["attn"].startswith("forward: aten.slice.Tensor gathers arg 0 (2, 3, 24) [Shard(dim=2)] over TP")
    assert "'attn' (forward): aten.slice.Tensor gathers arg 0" in str(report)


def test_interleaved_sections_gather_nothing():
    report = _report(InterleavedShard(0, 3))
    assert report.counts == {} and report.modules() == {}, str(report)
    assert str(report) == "no op gathered a sharded tensor"


def _llama_report(mode: str):
    with fake_world(4):
        forget_dtensor_caches()
        mesh = vescale.init_mesh((2, 2), ("DP", "TP"), device_type="cpu")
        torch.manual_seed(0)
        model = tiny_llama()
        vescale.parallelize(model, llama_plan(mesh, model.config, sequence_parallel=True, zero3=True), mesh, mode=mode)
        ids = torch.randint(0, 128, (4, 16))
        reports = []
        for _ in range(2):  # static: the recording step, then a static one
            with gathers(model) as report:
                model(input_ids=ids, labels=ids).loss.backward()
            reports.append(report)
        return reports


def test_the_zoo_llama_gathers_nothing_inside_its_layers():
    # llama_plan gathers the logits where the LM head returns them (a plan move, not an op's gather),
    # so the loss's log_softmax runs on whole rows and nothing in the model gathers, in either mode.
    for mode in ("static", "eager"):
        for report in _llama_report(mode):
            assert report.counts == {}, f"{mode}: {report}"


def test_ops_outside_the_model_are_named_so():
    from torch.distributed.tensor import distribute_tensor

    with fake_world(2):
        forget_dtensor_caches()
        mesh = vescale.init_mesh((2,), ("TP",), device_type="cpu")
        vescale.dispatch.install()
        x = distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)])
        with gathers(nn.Linear(2, 2)) as report:
            x[:, 1:3]
        (g,) = report.counts
        assert g.module is None and report.modules() == {"<outside>": report.modules()["<outside>"]}
        assert str(g).startswith("outside the model (forward): aten.slice.Tensor gathers arg 0 (4, 6) [Shard(dim=1)]")
