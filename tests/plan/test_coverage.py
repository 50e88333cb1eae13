"""No silent no-ops, at lowering time: regex input keys, explain()'s per-mesh-dim coverage report,
and parallelize(strict=True) refusing a plan that does nothing on a mesh dim. Fake (2, 2) mesh."""

import pytest
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

import vescale
from vescale import PlanError, VescalePlan
from vescale.plan.lower import KeyPattern
from vescale.model_state import state_of


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, input_ids, labels=None, **kwargs):
        return self.fc(input_ids)


def _keys(ir, module=""):
    return [(e.key, e.targets) for e in ir.entries if e.module == module and e.hook == "forward_pre"]


def test_input_keys_are_regexes(mesh):
    plan = VescalePlan().shard(r"<in>[(input_ids|labels)]", Shard(0), mesh="DP")
    keys = _keys(vescale.explain(Net(), plan, mesh))
    assert [k for k, _ in keys] == ["input_ids", "labels"]  # both arguments, by name
    # Escaped brackets and backslashes in the key work too.
    plan = VescalePlan().shard(r"<in>\[\w+_ids\]", Shard(0), mesh="DP")
    assert [k for k, _ in _keys(vescale.explain(Net(), plan, mesh))] == ["input_ids"]


def test_kwargs_keys_are_kept_for_the_call(mesh):
    # No named argument matches: the forward takes **kwargs, so the key is matched at each call.
    plan = VescalePlan().shard(r"<in>[extra]", Shard(0), mesh="DP").shard(r"<in>[pixel_.*]", Shard(0), mesh="DP")
    keys = [k for k, _ in _keys(vescale.explain(Net(), plan, mesh))]
    assert keys == ["extra", "pixel_.*"] and isinstance(keys[1], KeyPattern) and not isinstance(keys[0], KeyPattern)


def test_report_lists_replicated_parameters_and_idle_dims(mesh):
    plan = VescalePlan().shard(r"fc\.weight", Shard(0), mesh="TP")
    ir = vescale.explain(Net(), plan, mesh)
    cov = ir.coverage()
    assert cov["TP"]["sharded"] == ["fc.weight"] and cov["TP"]["replicated"] == ["fc.bias"]
    assert cov["DP"]["replicated"] == ["fc.weight", "fc.bias"] and cov["DP"]["activations"] == []
    assert ir.idle_mesh_dims() == ["DP"]
    text = str(ir).splitlines()
    assert "# DP: 2 of 2 parameters replicated: fc.weight, fc.bias; no activation placed" in text
    assert "# TP: 1 of 2 parameters replicated: fc.bias; no activation placed" in text
    assert text[-1].startswith("# WARNING: the plan does nothing on mesh dim(s) ['DP']")
    # Splitting the batch on DP makes DP do something; a Replicate activation alone would not.
    busy = VescalePlan().shard(r"fc\.weight", Shard(0), mesh="TP").shard(r"<in>[input_ids]", Shard(0), mesh="DP")
    assert vescale.explain(Net(), busy, mesh).idle_mesh_dims() == []
    idle = VescalePlan().shard(r"fc\.weight", Shard(0), mesh="TP").shard(r"<in>[input_ids]", Replicate(), mesh="DP")
    assert vescale.explain(Net(), idle, mesh).idle_mesh_dims() == ["DP"]
    # So does a batch each DP rank passes its share of (plan.annotate, the per-rank mode); a
    # gradient annotation does not split work.
    shares = VescalePlan().shard(r"fc\.weight", Shard(0), mesh="TP").annotate(r"<in>[input_ids]", Shard(0), mesh="DP")
    assert vescale.explain(Net(), shares, mesh).idle_mesh_dims() == []
    grad_note = VescalePlan().shard(r"fc\.weight", Shard(0), mesh="TP").annotate(r"fc\.bias\.grad", Shard(0), mesh="DP")
    assert vescale.explain(Net(), grad_note, mesh).idle_mesh_dims() == ["DP"]


def test_strict_refuses_a_plan_idle_on_a_mesh_dim(mesh):
    model = Net()
    plan = VescalePlan().shard(r"fc\.weight", Shard(0), mesh="TP")
    with pytest.raises(PlanError, match=r"strict=True\): the plan does nothing on mesh dim\(s\) \['DP'\]"):
        vescale.parallelize(model, plan, mesh, strict=True)
    assert type(model.fc.weight) is nn.Parameter and not (state_of(model).ir is not None)  # nothing changed
