"""HF ``LlamaForCausalLM`` with its default attention (SDPA) under TP=2 and DP=2 x TP=2.

Each configuration trains 4 AdamW steps from the single-device initial weights on the same global
batches and must match the single-device run: losses, first-step gradients and final parameters
within 1e-5 (fp32; what differs is the order of floating-point sums inside collectives, sharded
matmuls and the attention kernel's blocking over local sizes — a few ulps; a wrong head pairing or
mask moves losses by ~1e-2). With attention dropout 0.1 the single-device reference runs under
``vescale.random.consistent()``, so both draw the dropout mask from vescale's generator by global
element index: the same tolerance holds.

Equal losses cannot show a split happened, so each run also records the local shapes of the
q/k/v projections' outputs (heads split over TP, batch over DP) and which SDPA kernel ran.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import pytest
import torch
import torch.distributed as dist

import vescale
from vescale.random import consistent
from vescale.testing import run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_hf_llama

STEPS, LR, TOL, SEED = 4, 1e-3, 1e-5, 7
BATCH, SEQ = 4, 16
aten = torch.ops.aten
# name: (mesh shape, mesh names, attention dropout)
CONFIGS_2 = {"TP=2": ((2,), ("TP",), 0.0), "TP=2, attention dropout 0.1": ((2,), ("TP",), 0.1)}
CONFIGS_4 = {"DP=2xTP=2": ((2, 2), ("DP", "TP"), 0.0)}


def _value(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _build(dropout: float):
    torch.manual_seed(0)
    model = tiny_hf_llama(attention_dropout=dropout)
    assert model.config._attn_implementation == "sdpa", "the HF model's default attention must be SDPA"
    return model


class _Kernels(torch.utils._python_dispatch.TorchDispatchMode):
    """Records which attention kernels ran (on whatever tensors)."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.name() or func in (aten.bernoulli_.float, aten._safe_softmax.default):
            self.seen.add(func.name())
        return func(*args, **(kwargs or {}))


def _train(model) -> dict:
    shapes = {}
    attn = model.model.layers[0].self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(attn, name).register_forward_hook(
            lambda m, a, out, name=name: shapes.setdefault(name, tuple(getattr(out, "_local_tensor", out).shape)) and None
        )
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads, kernels = [], None, _Kernels()
    for step, (input_ids, labels) in enumerate(synthetic_batches(STEPS, BATCH, SEQ, 128, seed=1)):
        with kernels if step == 0 else contextlib.nullcontext():
            loss = model(input_ids=input_ids, labels=labels).loss
            loss.backward()
        if grads is None:
            grads = {n: _value(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(_value(loss).item())
    params = {n: _value(p) for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params, "shapes": shapes, "kernels": kernels.seen}


@functools.cache
def _single_device(dropout: float) -> dict:
    model = _build(dropout)
    vescale.manual_seed(SEED)
    with consistent():
        return _train(model)


def _distributed(configs):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    results = {}
    for name, (shape, names, dropout) in configs.items():
        mesh = vescale.init_mesh(shape, names)
        model = _build(dropout)
        vescale.parallelize(model, llama_plan(mesh, model.config, sequence_parallel=False), mesh)
        vescale.manual_seed(SEED)
        out = _train(model)
        results[name] = out if dist.get_rank() == 0 else None
    return results


def _check(results, configs):
    cfg = tiny_hf_llama().config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    for name, (shape, names, dropout) in configs.items():
        got, ref = results[name], _single_device(dropout)
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
            assert abs(a - b) <= TOL, f"{name}: step {step} loss {a} vs single-device {b}"
        for key in ("grads", "params"):
            diff, where = max(((got[key][k] - ref[key][k]).abs().max().item(), k) for k in ref[key])
            assert diff <= TOL, f"{name}: {key} of {where} differs by {diff:.3g}"
        assert ref["losses"][-1] < ref["losses"][0]
        sizes = dict(zip(names, shape))
        tp, dp = sizes.get("TP", 1), sizes.get("DP", 1)
        assert got["shapes"] == {
            "q_proj": (BATCH // dp, SEQ, cfg.num_attention_heads // tp * head_dim),
            "k_proj": (BATCH // dp, SEQ, cfg.num_key_value_heads // tp * head_dim),
            "v_proj": (BATCH // dp, SEQ, cfg.num_key_value_heads // tp * head_dim),
        }, f"{name}: local q/k/v shapes {got['shapes']}"
        if dropout:  # no fused CPU kernel takes dropout: PyTorch's math path, mask from vescale's RNG
            assert "aten::bernoulli_.float" in got["kernels"], got["kernels"]
        else:
            assert {"aten::_scaled_dot_product_flash_attention_for_cpu",
                    "aten::_scaled_dot_product_flash_attention_for_cpu_backward"} <= got["kernels"], got["kernels"]


@pytest.mark.multiproc
def test_hf_llama_default_sdpa_two_ranks():
    _check(run_on_ranks(_distributed, 2, CONFIGS_2)[0], CONFIGS_2)


@pytest.mark.multiproc
def test_hf_llama_default_sdpa_dp_x_tp():
    _check(run_on_ranks(_distributed, 4, CONFIGS_4)[0], CONFIGS_4)
