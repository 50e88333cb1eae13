"""Issue 27, defect 2, end to end: one sequence per DP rank with a global batch TP does not divide.

The zoo LLaMA under ``llama_plan(sequence_parallel=True, zero3=True)`` crashed in its first forward
on DP=2 x TP=4 (global batch 2), DP=2 x TP=8 and DP=4 x TP=8: attention's scores, flattened to
(batch x heads) with batch on DP and heads on TP, could not be viewed back (PyTorch's view rule,
``vescale/dispatch/fast/viewrule.py``). The smallest real world that has it is 6 ranks (4 cannot: DP=2
x TP=2 needs an even batch, which TP=2 divides): DP=2 x TP=3 with a global batch of 2, on the tiny
LLaMA widened to 6 heads (3 key/value heads) so that every ZeRO-3 shard is even (DP x TP divides
each sharded dim).

On 6 gloo ranks, eager and Static Eager: 3 SGD steps match the single device within 1e-6 (losses,
first-step gradients, final parameters: fp32, only the reduction order of the sharded matmuls and
collectives differs, ~1e-7 on gradients of ~0.1; SGD, not Adam, whose normalised update turns a
last-bit difference in a near-zero gradient into a whole step), and the split is real: ``o_proj`` takes a local (1, 16, 32) input on every rank (one
sequence, a third of the heads' columns; the single device's is (2, 16, 96)).
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch

import vescale
from vescale.testing import global_value, run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_llama

pytestmark = pytest.mark.multiproc
STEPS, BATCH, SEQ, VOCAB = 3, 2, 16, 96
SIZES = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=192, vocab_size=VOCAB)


def _train(model, mode_hook=None) -> dict:
    shapes = []
    model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(
        lambda m, args: shapes.append(tuple((args[0]._local_tensor if hasattr(args[0], "_local_tensor") else args[0]).shape)))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], None
    for input_ids, labels in synthetic_batches(STEPS, BATCH, SEQ, VOCAB, seed=3):
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        if grads is None:
            grads = {n: global_value(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(global_value(loss).item())
    params = {n: global_value(p) for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params, "o_proj_inputs": sorted(set(shapes))}


@functools.cache
def _single_device() -> dict:
    torch.manual_seed(0)
    return _train(tiny_llama(**SIZES))


def _distributed(mode: str) -> dict:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = vescale.init_mesh((2, 3), ("DP", "TP"))
    torch.manual_seed(0)
    model = tiny_llama(**SIZES)
    vescale.parallelize(model, llama_plan(mesh, model.config, sequence_parallel=True, zero3=True), mesh, mode=mode)
    return _train(model)


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_dp2_tp3_global_batch_2_trains_as_one_device(mode):
    want = _single_device()
    results = run_on_ranks(_distributed, 6, mode)
    assert want["o_proj_inputs"] == [(BATCH, SEQ, 96)]
    for got in results:
        assert got["o_proj_inputs"] == [(1, SEQ, 32)]  # batch split over DP, heads over TP
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), atol=1e-6, rtol=0)
        for kind in ("grads", "params"):
            for name, value in want[kind].items():
                torch.testing.assert_close(got[kind][name], value, atol=1e-6, rtol=0, msg=f"{kind} {name}")
