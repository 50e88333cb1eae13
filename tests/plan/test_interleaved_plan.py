"""InterleavedShard in plans: its constructor, lowering (IR text, negative dims, section sizes) and
the error for an interleaved dim sharded on a second mesh dimension. Fake (2, 2) mesh, no ranks."""

import copy
import pickle

import pytest
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from vescale import INIT, RUN, InterleavedShard, PlanError, VescalePlan, explain


class Fused(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(4, 12)
        self.odd = nn.Linear(4, 10)

    def forward(self, x):
        return self.qkv(x)


def test_constructor_checks_and_equality():
    p = InterleavedShard(0, 3)
    assert (p.dim, p.interleave) == (0, 3)
    assert repr(p) == "InterleavedShard(dim=0, interleave=3)" and str(p) == "IS(0, 3)"
    # The same layout as DTensor's _StridedShard: equal, same hash, so DTensor treats them alike.
    assert p == _StridedShard(0, split_factor=3) and hash(p) == hash(_StridedShard(0, split_factor=3))
    assert p != InterleavedShard(0, 2) and p != Shard(0)
    assert repr(pickle.loads(pickle.dumps(p))) == repr(p) and repr(copy.deepcopy(p)) == repr(p)
    with pytest.raises(ValueError, match="interleave must be a positive int"):
        InterleavedShard(0, 0)
    with pytest.raises(TypeError, match="dim must be an int"):
        InterleavedShard("0", 3)


def test_lowering_prints_and_normalises(mesh):
    plan = VescalePlan().shard(r"qkv\.weight", InterleavedShard(-2, 3), mesh="TP")
    plan.shard(r"qkv\.bias", InterleavedShard(0, 3), mesh="TP")
    text = str(explain(Fused(), plan, mesh))
    assert "qkv.param:weight::distribute(R,DP; IS(0,3),TP)" in text
    assert "qkv.param:bias::distribute(R,DP; IS(0,3),TP)" in text


def test_sections_must_be_equal(mesh):
    plan = VescalePlan().shard(r"odd\.weight", InterleavedShard(0, 3), mesh="TP")
    with pytest.raises(PlanError, match=r"size 10 on dim 0, which does not split into 3 equal sections"):
        explain(Fused(), plan, mesh)


def test_interleaved_dim_cannot_be_sharded_twice(mesh):
    plan = VescalePlan().shard(r"qkv\.weight", InterleavedShard(0, 3), mesh="TP")
    plan.shard(r".*weight", Shard(0), mesh="DP", phase=INIT).shard(r".*weight", Replicate(), mesh="DP", phase=RUN)
    with pytest.raises(PlanError, match=r"InterleavedShard dim cannot be sharded on a second mesh dimension"):
        explain(Fused(), plan, mesh)
    # ZeRO-3 on the other dim is fine.
    ok = VescalePlan().shard(r"qkv\.weight", InterleavedShard(0, 3), mesh="TP")
    ok.shard(r"qkv\.weight", Shard(1), mesh="DP", phase=INIT).shard(r"qkv\.weight", Replicate(), mesh="DP", phase=RUN)
    assert "gather(S(1),DP; IS(0,3),TP->R,DP; IS(0,3),TP)" in str(explain(Fused(), ok, mesh))
