"""HF GPT2LMHeadModel, unchanged, default config (dropouts 0.1 on, tied embeddings, Conv1D, KV cache
on; GPT-2's default SDPA attention), under the zoo plan on TP=2 and DP=2 x TP=2 + ZeRO-3, against one device.

Every step draws its dropout masks from vescale's RNG with the same seed on one device (under
``vescale.random.consistent()``) and on the mesh, so the runs see the same masks. Tolerances
(fp32): losses at each of 5 AdamW steps and first-step gradients within 1e-5 (only the order of
floating-point sums differs); final parameters within 1e-5, except the key section of each
``c_attn.bias``: softmax is invariant to a bias added to every key, so its exact gradient is 0 and
both runs hold rounding noise (~1e-10, checked) that AdamW divides by eps=1e-8 — each step moves
it by up to lr x noise/eps on either run, so it is compared within 1e-4.
Local shapes show the split happened (c_attn's weight is split by heads; under ZeRO-3 the tied
embedding is stored as 1/DP of itself). After training, an
evaluation forward (dropout off, so SDPA takes PyTorch's fused CPU flash kernel rather than the
math path training takes) must give the single-device logits within 1e-5.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.distributed as dist

import vescale
from vescale.placement import is_interleaved
from vescale.testing import run_on_ranks
from vescale.zoo import gpt2_plan, synthetic_batches, tiny_hf_gpt2

STEPS, LR, TOL = 5, 1e-3, 1e-5
H = 64  # tiny n_embd


def _value(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _train(model) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], None
    for step, (input_ids, labels) in enumerate(synthetic_batches(STEPS, 4, 16, 128, seed=1)):
        vescale.manual_seed(100 + step)  # this step's dropout masks, the same on every run
        with vescale.random.consistent():
            loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        if grads is None:
            grads = {n: _value(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(_value(loss).item())
    model.eval()
    (input_ids, _), = synthetic_batches(1, 4, 16, 128, seed=7)
    with torch.no_grad():
        logits = _value(model(input_ids=input_ids).logits)
    return {"losses": losses, "grads": grads, "params": {n: _value(p) for n, p in model.named_parameters()},
            "eval_logits": logits, "attn": model.config._attn_implementation}


def _build():
    vescale.manual_seed(0)
    return tiny_hf_gpt2()


@functools.cache
def _single_device() -> dict:
    return _train(_build())


def _distributed(shape, names, zero3):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = vescale.init_mesh(shape, names)
    model = _build()
    vescale.parallelize(model, gpt2_plan(mesh, model.config, zero3=zero3), mesh)
    attn, mlp = model.transformer.h[0].attn, model.transformer.h[0].mlp
    facts = {
        "tied": model.lm_head.weight is model.transformer.wte.weight,
        "c_attn": (tuple(attn.c_attn.weight.to_local().shape), is_interleaved(attn.c_attn.weight.placements[-1])),
        "c_attn_bias": tuple(attn.c_attn.bias.to_local().shape),
        "c_proj": tuple(attn.c_proj.weight.to_local().shape),
        "c_fc": tuple(mlp.c_fc.weight.to_local().shape),
        "wte": tuple(model.transformer.wte.weight.to_local().shape),
    }
    out = _train(model)
    return {**out, "facts": facts} if dist.get_rank() == 0 else None


def _key_bias(name: str) -> bool:
    return name.endswith("attn.c_attn.bias")


def _check(got: dict) -> None:
    ref = _single_device()
    assert got["attn"] == ref["attn"] == "sdpa", (got["attn"], ref["attn"])
    diff = (got["eval_logits"] - ref["eval_logits"]).abs().max().item()
    assert diff <= TOL, f"evaluation logits differ from single device by {diff:.3g}"
    assert ref["losses"][-1] < ref["losses"][0], "training must make progress for the check to mean something"
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert abs(a - b) <= TOL, f"step {step}: loss {a} vs single-device {b}"
    for name, g in ref["grads"].items():
        assert (got["grads"][name] - g).abs().max().item() <= TOL, f"first-step gradient of {name}"
    for name, p in ref["params"].items():
        diff = (got["params"][name] - p).abs()
        if _key_bias(name):
            keys = slice(H, 2 * H)
            assert ref["grads"][name][keys].abs().max() < 1e-7 and got["grads"][name][keys].abs().max() < 1e-7
            assert diff[keys].max().item() <= 1e-4, f"{name} (key section)"
            diff[keys] = 0
        assert diff.max().item() <= TOL, f"final parameter {name} differs by {diff.max().item():.3g}"


@pytest.mark.multiproc
def test_tp2_matches_single_device():
    got = run_on_ranks(_distributed, 2, (2,), ("TP",), False)[0]
    facts = got["facts"]
    assert facts["tied"]
    assert facts["c_attn"] == ((H, 3 * H // 2), True)  # Conv1D (in, out): q|k|v heads split on dim 1
    assert facts["c_attn_bias"] == (3 * H // 2,)
    assert facts["c_proj"] == (H // 2, H) and facts["c_fc"] == (H, 4 * H // 2)
    assert facts["wte"] == (128, H)  # tied embedding replicated on TP
    _check(got)


@pytest.mark.multiproc
def test_dp2_tp2_zero3_matches_single_device():
    got = run_on_ranks(_distributed, 4, (2, 2), ("DP", "TP"), True)[0]
    facts = got["facts"]
    assert facts["tied"]
    assert facts["c_attn"] == ((H // 2, 3 * H // 2), True)  # ZeRO-3 on dim 0 (DP), heads on dim 1 (TP)
    assert facts["c_proj"] == (H // 4, H) and facts["c_fc"] == (H // 2, 4 * H // 2)
    assert facts["wte"] == (128 // 2, H)  # the tied embedding: ZeRO-3'd too (1/DP at rest), still tied
    _check(got)
