"""A planned input key that matches nothing at a module's first call is an error (2 gloo ranks):
the DP batch split of a **kwargs forward under a misspelt key would otherwise do nothing while
losses still match. Regex keys over **kwargs place every matching keyword."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Shard

import vescale
from vescale import PlanError, VescalePlan
from vescale.testing import run_on_ranks

pytestmark = pytest.mark.multiproc


class KwNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, **kwargs):
        self.seen = {k: tuple(v.to_local().shape) if hasattr(v, "to_local") else tuple(v.shape) for k, v in kwargs.items()}
        return self.fc(kwargs["input_ids"]).sum()


class Opt(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, labels=None):
        return self.fc(x).sum()


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return {"logits": y, "aux_logits": y * 2, "hidden": y + 1}


def _run():
    mesh = vescale.init_mesh((2,), ("DP",))
    out = {}
    x = torch.randn(6, 4)
    # A misspelt key on a **kwargs forward: accepted by lowering, refused at the first call.
    typo = vescale.parallelize(KwNet(), VescalePlan().shard(r"<in>[input_id]", Shard(0), mesh="DP"), mesh)
    try:
        typo(input_ids=x)
        out["typo"] = None
    except PlanError as e:
        out["typo"] = str(e)
    # A regex over keywords places each match (local batch 3 of 6).
    both = vescale.parallelize(KwNet(), VescalePlan().shard(r"<in>[(input_ids|pixel_.*)]", Shard(0), mesh="DP"), mesh)
    both(input_ids=x, pixel_values=x.clone())
    out["regex"] = both.seen
    # An optional argument left out after the first call is left alone; at the first call it is an error.
    plan = VescalePlan().shard(r"<in>[(x|labels)]", Shard(0), mesh="DP")
    opt = vescale.parallelize(Opt(), plan, mesh)
    opt(x, labels=x.clone())
    opt(x)  # second call without labels: fine
    out["later"] = True
    try:
        vescale.parallelize(Opt(), plan, mesh)(x)
        out["first"] = None
    except PlanError as e:
        out["first"] = str(e)
    # Output keys are regexes over dict fields too; one that matches no field is an error.
    dict_out = vescale.parallelize(DictOut(), VescalePlan().shard(r"<out>[.*logits]", Shard(0), mesh="DP"), mesh)
    res = dict_out(x)
    out["out_regex"] = {k: tuple(v.to_local().shape) for k, v in res.items()}
    try:
        vescale.parallelize(DictOut(), VescalePlan().shard(r"<out>[logit]", Shard(0), mesh="DP"), mesh)(x)
        out["out_typo"] = None
    except PlanError as e:
        out["out_typo"] = str(e)
    return out


def test_first_call_must_match_every_key():
    for out in run_on_ranks(_run, 2):
        assert out["typo"].startswith("<root>.<in>[input_id] (plan statement(s) #0) matched no argument of the module's first call, which passed ['input_ids']")
        assert out["regex"] == {"input_ids": (3, 4), "pixel_values": (3, 4)}
        assert out["later"]
        assert "<root>.<in>[labels]" in out["first"] and "which passed ['x']" in out["first"]
        # Both *logits fields are placed (split over DP: 3 of 6 rows); "hidden" is not (6 rows).
        assert out["out_regex"] == {"logits": (3, 4), "aux_logits": (3, 4), "hidden": (6, 4)}
        assert out["out_typo"].startswith("<root>.<out>[logit]: the module's output has no field matching 'logit'")
