"""Single-device equivalence of the zoo plan on both LLaMA models (ours and HF's, unchanged).

Each configuration trains 5 AdamW steps from the single-device initial weights on the same global
batches (no randomness during training) and must match the single-device run:

* loss at every step within 1e-5 (fp32; the only difference is the order of floating-point
  reductions inside collectives and sharded matmuls, which moves fp32 sums by a few ulps);
* gradients after the first backward within 1e-5 — checked because AdamW is insensitive to a
  uniformly mis-scaled gradient, so matching parameters alone would not prove gradients right;
* gathered final parameters within 1e-5.

Equal numbers cannot show that anything was split (a plan that replicated everything, or DP where
every rank trained on the whole batch, would match too), so each configuration also runs
``split_checks.check_llama_split`` on every rank: each parameter's local shard, the first decoder
layer's share of the batch (and of the sequence under SP) and the collectives of a probe step.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.distributed as dist

import vescale
from vescale.testing import run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_hf_llama, tiny_llama

from split_checks import check_llama_split, probe_batch
from vescale.model_state import state_of

STEPS, LR, TOL = 5, 1e-3, 1e-5
MODELS = {"ours": lambda: tiny_llama(), "hf": lambda: tiny_hf_llama(use_cache=False)}

# (name, mesh shape, mesh names, sequence_parallel, zero3)
CONFIGS_2 = [
    ("TP=2", (2,), ("TP",), False, False),
    ("TP=2+SP", (2,), ("TP",), True, False),
    ("DP=2", (2,), ("DP",), False, False),
    ("ZeRO-3 DP=2", (2,), ("DP",), False, True),
]
CONFIGS_4 = [
    ("TP=4", (4,), ("TP",), False, False),
    ("DP=2xTP=2+SP+ZeRO-3", (2, 2), ("DP", "TP"), True, True),
]


def _build(model_name: str):
    torch.manual_seed(0)
    return MODELS[model_name]()


def _value(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _train(model) -> dict:
    """STEPS AdamW steps; returns losses, the first step's gradients and the final parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, first_grads = [], None
    for input_ids, labels in synthetic_batches(STEPS, 4, 16, 128, seed=1):
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        if first_grads is None:
            first_grads = {n: _value(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(_value(loss).item())
    return {"losses": losses, "grads": first_grads, "params": {n: _value(p) for n, p in model.named_parameters()}}


@functools.cache
def _single_device(model_name: str) -> dict:
    return _train(_build(model_name))


def _distributed(configs):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    results = {}
    for model_name in MODELS:
        for name, shape, names, sp, zero in configs:
            mesh = vescale.init_mesh(shape, names)
            model = _build(model_name)
            vescale.parallelize(model, llama_plan(mesh, model.config, sequence_parallel=sp, zero3=zero), mesh)
            out = _train(model)
            sizes = dict(zip(names, shape))
            check_llama_split(model, probe_batch(), tp=sizes.get("TP", 1), dp=sizes.get("DP", 1), sequence_parallel=sp,
                              zero3=zero, label=f"{model_name} model, {name}")
            results[(model_name, name)] = out if dist.get_rank() == 0 else None
    return results


def _max_diff(a: dict, b: dict) -> tuple[float, str]:
    return max(((a[k] - b[k]).abs().max().item(), k) for k in b)


def _check(results: dict, configs) -> None:
    for model_name in MODELS:
        ref = _single_device(model_name)
        for name, *_ in configs:
            got = results[(model_name, name)]
            label = f"{model_name} model, {name}"
            for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
                assert abs(a - b) <= TOL, f"{label}: step {step} loss {a} vs single-device {b}"
            diff, where = _max_diff(got["grads"], ref["grads"])
            assert diff <= TOL, f"{label}: first-step gradient of {where} differs by {diff:.3g}"
            diff, where = _max_diff(got["params"], ref["params"])
            assert diff <= TOL, f"{label}: final parameter {where} differs by {diff:.3g}"
            assert ref["losses"][-1] < ref["losses"][0], "training must make progress for the check to mean something"


@pytest.mark.multiproc
def test_two_rank_configs_match_single_device():
    _check(run_on_ranks(_distributed, 2, CONFIGS_2)[0], CONFIGS_2)


@pytest.mark.multiproc
def test_four_rank_configs_match_single_device():
    _check(run_on_ranks(_distributed, 4, CONFIGS_4)[0], CONFIGS_4)


def _hsdp(mode: str) -> dict:
    """HSDP on (DPR=2, DPS=2): ZeRO-3 over DPS (``llama_plan(dp="DPS")``), the batch split over both,
    replicas of each ZeRO group across DPR (the 1,000-rank recipe of docs/scale.md)."""
    from torch.distributed.tensor import Shard

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = vescale.init_mesh((2, 2), ("DPR", "DPS"))
    model = _build("ours")
    plan = llama_plan(mesh, model.config, tp=None, dp="DPS", zero3=True)
    for key in (r"<in>\[input_ids\]", r"<in>\[labels\]"):
        plan.shard(key, Shard(0), mesh="DPR")
    vescale.parallelize(model, plan, mesh, mode=mode)
    rows = {n: (p.shape[0], p._local_tensor.shape[0]) for n, p in model.named_parameters()}
    out = _train(model)
    out.update(rows=rows, stats=dict(state_of(model).reducer.stats))
    return out if dist.get_rank() == 0 else None


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["eager", "static"])
def test_hsdp_matches_single_device(mode):
    """ZeRO shards over DPS only (half of every weight's rows on a rank, not a quarter), gradients
    reduce-scattered over DPS and then all-reduced over DPR, and the single-device run's losses,
    gradients and parameters within 1e-5."""
    got = run_on_ranks(_hsdp, 4, mode)[0]
    assert all(local == -(-rows // 2) for rows, local in got["rows"].values()), got["rows"]
    assert got["stats"]["reduce_scatter"] > 0 and got["stats"]["all_reduce"] >= got["stats"]["reduce_scatter"]
    ref = _single_device("ours")
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert abs(a - b) <= TOL, f"HSDP {mode}: step {step} loss {a} vs single-device {b}"
    for key in ("grads", "params"):
        diff, where = _max_diff(got[key], ref[key])
        assert diff <= TOL, f"HSDP {mode}: {key} of {where} differs by {diff:.3g}"
