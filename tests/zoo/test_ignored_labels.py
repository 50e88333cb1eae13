"""Data parallelism with labels ignored unevenly across ranks: the loss is the single device's.

A causal-LM batch often masks positions out of the loss (``labels == -100``: padding, prompts).
When the masked positions fall unevenly on the DP ranks, PyTorch's DTensor rule reports the
average of the ranks' own means; vescale reports the single device's mean (each rank's sum over
the global count, ``vescale/dispatch/coverage/semantics.py``), in eager and Static Eager mode, for the zoo
LLaMA and HF's unchanged ``LlamaForCausalLM``.

Tolerance: loss and gradients within 1e-6 of one device (fp32; sums over ranks and sharded matmuls
add in another order). The batch below makes the two rules differ by ~5e-3, so the check cannot
pass with the ranks' means.
"""

from __future__ import annotations

import logging

import pytest
import torch

import vescale
from vescale.testing import run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_hf_llama, tiny_llama

MODELS = {"ours": lambda: tiny_llama(), "hf": lambda: tiny_hf_llama(use_cache=False)}
STEPS, TOL = 3, 1e-6


def _batch():
    input_ids, labels = synthetic_batches(1, 4, 16, 128, seed=1)[0]
    labels = labels.clone()
    labels[0, :12] = -100  # rank 0's rows ignore 13 of their 30 shifted labels, rank 1's none
    labels[1, :3] = -100
    return input_ids, labels


def _grad(p):
    g = p.grad
    return (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()


def _train(model_name: str, mode: str | None):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = MODELS[model_name]()
    if mode is not None:
        mesh = vescale.init_mesh((2,), ("DP",))
        vescale.parallelize(model, llama_plan(mesh, model.config), mesh, mode=mode)
    input_ids, labels = _batch()
    losses, grads, local_batch = [], None, None
    for _ in range(STEPS):  # the same batch: the first step records in static mode, the rest run static
        out = model(input_ids=input_ids, labels=labels)
        out.loss.backward()
        losses.append(out.loss.item())
        grads = {n: _grad(p) for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        local_batch = out.logits.to_local().shape[0] if hasattr(out.logits, "to_local") else out.logits.shape[0]
    static_steps = vescale.static.static_runtime(model).static_steps if mode == "static" else 0
    return losses, grads, local_batch, static_steps


@pytest.mark.multiproc
@pytest.mark.parametrize("model_name", list(MODELS))
def test_unevenly_ignored_labels_give_the_single_device_loss(model_name):
    ref_losses, ref_grads, _, _ = _train(model_name, None)
    for mode in ("eager", "static"):
        losses, grads, local_batch, static_steps = run_on_ranks(_train, 2, model_name, mode)[0]
        assert local_batch == 2, f"{mode}: the batch was not split over DP"
        if mode == "static":
            assert static_steps >= 1, "no step ran static"
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b) <= TOL, f"{model_name} {mode}: step {step} loss {a} vs single device {b}"
        diff, name = max(((grads[k] - ref_grads[k]).abs().max().item(), k) for k in ref_grads)
        assert diff <= TOL, f"{model_name} {mode}: gradient of {name} differs by {diff:.3g}"
