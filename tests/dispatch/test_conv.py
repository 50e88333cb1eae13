"""Convolutions on DTensors: an unplanned (plain) image batch meets the DTensor weights as Replicate.

Before, PyTorch's convolution backward handler asserted its input was a DTensor (a bare
AssertionError). Here a Conv2d + Linear model with a plain input and a TP-sharded Linear trains
one step on 2 ranks; output, weight gradients (Replicate conv weight, reduced by vescale) and the
Linear's local shard shape are checked against one device within 1e-6 (fp32 sums reordered by the
sharded matmul only). A sharded conv weight, which PyTorch's rule would mislabel, is refused with
the statement that fixes it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import vescale
from vescale import Replicate, Shard, VescalePlan
from vescale.dispatch.coverage.errors import MissingShardingRule
from vescale.testing import run_on_ranks

TOL = 1e-6


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 25, 8))


def _step(model):
    x = torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(1))
    y = model(x)
    y.square().sum().backward()
    full = lambda t: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()
    return full(y), {n: full(p.grad) for n, p in model.named_parameters()}


def _ranks(shard_conv: bool):
    mesh = vescale.init_mesh((2,), ("TP",))
    model = _model()
    plan = VescalePlan().shard(r"2\.weight", Shard(0), mesh="TP").shard(r"2\.bias", Shard(0), mesh="TP")
    if shard_conv:
        plan.shard(r"0\.weight", Shard(0), mesh="TP")
    vescale.parallelize(model, plan, mesh)
    try:
        out, grads = _step(model)
    except MissingShardingRule as e:
        return str(e)
    return out, grads, tuple(model[2].weight.to_local().shape), model[0].weight.grad.placements


@pytest.mark.multiproc
def test_conv2d_with_a_plain_input_under_tp_matches_single_device():
    out, grads, local_shape, conv_grad_placements = run_on_ranks(_ranks, 2, False)[0]
    ref_out, ref_grads = _step(_model())
    assert local_shape == (4, 100), "the Linear's weight must really be split over TP"
    assert conv_grad_placements == (Replicate(),)
    assert (out - ref_out).abs().max() <= TOL
    for name, g in ref_grads.items():
        assert (grads[name] - g).abs().max() <= TOL, name


@pytest.mark.multiproc
def test_a_sharded_conv_weight_is_refused_with_the_fix():
    message = run_on_ranks(_ranks, 2, True)[0]
    assert "convolution in module '0' has a sharded weight [Shard(dim=0)]" in message
    assert r'plan.shard(r"0\.weight", Replicate()' in message
