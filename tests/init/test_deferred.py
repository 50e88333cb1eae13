"""Deferred initialisation on 4 gloo ranks (DP=2 x TP=2 + ZeRO-3): models built on the meta device
are materialised shard by shard with exactly the single-device values (torch.equal), each rank
allocates only its shards, and meta models whose init vescale cannot replay get a clear error.

The single-device reference is the same model *built normally* on one device, with the same seed,
under ``vescale.random.consistent()`` (so its constructor draws from vescale's generator):
constructor draws that ``init_weights()`` overwrites included (HF's ``nn.Linear`` / ``nn.Embedding``
defaults, nested ``post_init`` calls). The generator must also be left where the normal build
leaves it: the next random numbers (a dropout mask) are the same. Mixtral is in the set because
its constructor draws in yet another order (experts)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import vescale
from vescale.init import DeferredInitError
from vescale.testing import run_on_ranks
from vescale.zoo import gpt2_plan, llama_plan, moe_plan, synthetic_batches, tiny_hf_gpt2, tiny_hf_mixtral, tiny_llama

pytestmark = pytest.mark.multiproc
BUILDERS = {
    "gpt2": (tiny_hf_gpt2, gpt2_plan),
    "llama": (tiny_llama, llama_plan),
    "mixtral": (tiny_hf_mixtral, moe_plan),
}


def _reference(build):
    """The normal build and the generator's next draws after it."""
    vescale.manual_seed(0)
    with vescale.random.consistent():
        ref = build()
        after = torch.rand(8)
    return ref, after


def _deferred():
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
    out = {}
    for name, (build, plan) in BUILDERS.items():
        ref, ref_after = _reference(build)
        with torch.device("meta"):
            model = build()
        vescale.manual_seed(0)
        vescale.parallelize(model, plan(mesh, model.config, zero3=True), mesh)
        with vescale.random.consistent():
            after = torch.rand(8)
        params = dict(model.named_parameters())
        out[name] = {
            "differ": [n for n, p in ref.named_parameters() if not torch.equal(params[n].full_tensor(), p)],
            "buffers_differ": [
                n for (n, b), (_, c) in zip(ref.named_buffers(), model.named_buffers())
                if not torch.equal(b, c.full_tensor() if hasattr(c, "full_tensor") else c)
            ],
            "meta_left": [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta],
            "generator_as_after_build": torch.equal(after, ref_after),
            "local": sum(p.to_local().numel() for p in model.parameters()),
            "global": sum(p.numel() for p in model.parameters()),
        }
        ids, labels = synthetic_batches(1, 4, 16, 128, seed=1)[0]
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        out[name]["trains"] = bool(torch.isfinite(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
    return out


def test_meta_models_get_single_device_values_in_shards():
    for out in run_on_ranks(_deferred, 4):
        for name, r in out.items():
            assert r["differ"] == [] and r["buffers_differ"] == [] and r["meta_left"] == [], (name, r)
            assert r["generator_as_after_build"], name
            # Only shards were allocated: block weights split over DP x TP, the rest over fewer dims.
            assert r["local"] < r["global"] / 2, name
            assert r["trains"], name


class NoInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 4))

    def forward(self, x):
        return x @ self.w


class PartialInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.empty(4))

    def forward(self, x):
        return self.fc(x) * self.scale


def _errors():
    mesh = vescale.init_mesh((2,), ("TP",))
    vescale.manual_seed(0)
    out = {}
    for name, cls in (("none", NoInit), ("partial", PartialInit)):
        with torch.device("meta"):
            model = cls()
        try:
            vescale.parallelize(model, vescale.VescalePlan(), mesh)
            out[name] = None
        except DeferredInitError as e:
            out[name] = str(e)
    # A module with reset_parameters only: replayed, equal to one device.
    with torch.device("meta"):
        lin = nn.Linear(4, 6)
    vescale.manual_seed(3)
    vescale.parallelize(lin, vescale.VescalePlan().shard(r"weight", vescale.Shard(0), mesh="TP"), mesh)
    ref = nn.Linear(4, 6)
    vescale.manual_seed(3)
    with torch.no_grad(), vescale.random.consistent():
        ref.reset_parameters()
    out["linear"] = torch.equal(lin.weight.full_tensor(), ref.weight) and torch.equal(lin.bias.full_tensor(), ref.bias)
    out["linear_local"] = tuple(lin.weight.to_local().shape)
    return out


def test_meta_models_without_replayable_init_are_refused():
    for out in run_on_ranks(_errors, 2):
        assert out["none"].startswith("deferred init: NoInit was built on the meta device but has no init code to replay")
        assert "reset_parameters() left parameters/buffers uninitialised (e.g. scale)" in out["partial"]
        assert out["linear"] and out["linear_local"] == (3, 4)
