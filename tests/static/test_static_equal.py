"""Static Eager mode computes eager mode's bits: every zoo model, every mode combination, ``torch.equal``.

Static Eager runs a module's body on local tensors with the recorded layouts; its docs promise the
same local ops on the same local values and the same collectives as eager mode. So the claim is
equality, not closeness: after each of 4 AdamW steps (the recording steps and the static ones) the
loss, every parameter's gradient and every parameter must equal eager mode's bit for bit. Top-k
routing (HF Mixtral, Qwen3-MoE) makes that more than a nicety: one low bit flips an expert choice
sooner or later, and a long static run then parts from eager mode's (issue 33: from step 906 of a
1,000-step Mixtral run).

Where the modes used to part (each was found with this test): the recording step's alias node per
module input and parameter, which summed a body's own gradients of a tensor before the others, where
eager mode adds each as it arrives (``vescale/static/shares.py``); and the vocabulary-parallel loss
kernel, which took each rank's log-sum-exp over its own classes where eager DTensor gathers the
logits (``vescale/static/local_loss.py``).

One set of 4 gloo ranks trains the configurations (a second one, in the long suite, HF's LLaMA and
Qwen3-MoE), on DP=2 x TP=2 (DP=2 x EP=2 for expert
parallelism), each with dropout on where the model has it, drawn by vescale's RNG:

* the zoo LLaMA and HF's LlamaForCausalLM: ``llama_plan`` with SP and ZeRO-3;
* HF Mixtral and Qwen3-MoE: ``moe_plan`` with SP and ZeRO-3 (batch-local MoE blocks, relabelled in
  static steps), and Mixtral with expert parallelism and ZeRO-3;
* HF GPT-2 (``gpt2_plan``, ZeRO-3) and diffusers' DiT (``dit_plan``, ZeRO-3), whose plans keep some
  modules eager: their boundaries wrap and unwrap.

Equal numbers cannot show that the static path ran: each configuration also requires static steps
(at least 2 of 4), a static step that dispatched fewer DTensor ops than an eager one, and
collectives in it (the model is split). About 80 s of CI on 2 cores.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import vescale
from vescale.debug import CollectiveCounter
from vescale.testing import run_on_ranks
from vescale.zoo import (
    dit_plan, gpt2_plan, llama_plan, moe_plan, synthetic_batches, tiny_dit, tiny_hf_gpt2, tiny_hf_llama,
    tiny_hf_mixtral, tiny_hf_qwen3_moe, tiny_llama,
)

STEPS, SEED = 4, 1234
DP_TP, DP_EP = ((2, 2), ("DP", "TP")), ((2, 2), ("DP", "EP"))

# name: (builder, plan maker, mesh)
CONFIGS = {
    "llama": (lambda: tiny_llama(attention_dropout=0.1, hidden_dropout=0.1),
              lambda mesh, c: llama_plan(mesh, c, sequence_parallel=True, zero3=True), DP_TP),
    "hf-llama": (lambda: tiny_hf_llama(use_cache=False, attention_dropout=0.1),
                 lambda mesh, c: llama_plan(mesh, c, sequence_parallel=True, zero3=True), DP_TP),
    "mixtral": (lambda: tiny_hf_mixtral(attention_dropout=0.1),
                lambda mesh, c: moe_plan(mesh, c, sequence_parallel=True, zero3=True), DP_TP),
    "qwen3-moe": (lambda: tiny_hf_qwen3_moe(attention_dropout=0.1),
                  lambda mesh, c: moe_plan(mesh, c, sequence_parallel=True, zero3=True), DP_TP),
    "mixtral-ep": (lambda: tiny_hf_mixtral(attention_dropout=0.1), lambda mesh, c: moe_plan(mesh, c, zero3=True), DP_EP),
    "gpt2": (tiny_hf_gpt2, lambda mesh, c: gpt2_plan(mesh, c, zero3=True), DP_TP),
    "dit": (lambda: tiny_dit(dropout=0.1), lambda mesh, c: dit_plan(mesh, c, zero3=True), DP_TP),
}


class _DTensorOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _value(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _losses(name: str, model):
    """The step losses of ``model`` on this configuration's data (the same global batches on every rank)."""
    if name == "dit":
        g = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            x, t = torch.randn(4, 4, 8, 8, generator=g), torch.randint(0, 1000, (4,), generator=g)
            c, target = torch.randint(0, 10, (4,), generator=g), torch.randn(4, 4, 8, 8, generator=g)
            yield ((model(x, timestep=t, class_labels=c).sample - target) ** 2).mean()
    else:
        for input_ids, labels in synthetic_batches(STEPS, 4, 16, 128, seed=1):
            yield model(input_ids=input_ids, labels=labels).loss


def _train(name: str, mode: str) -> dict:
    build, plan, (shape, names) = CONFIGS[name]
    mesh = vescale.init_mesh(shape, names)
    torch.manual_seed(0)
    model = build()
    vescale.parallelize(model, plan(mesh, model.config), mesh, mode=mode)
    vescale.manual_seed(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = {"losses": [], "grads": [], "params": []}
    steps = _losses(name, model)
    for _step in range(STEPS):
        ops, collectives = _DTensorOps(), CollectiveCounter()
        with ops, collectives:
            loss = next(steps)
            loss.backward()
        out["losses"].append(_value(loss))
        out["grads"].append({n: _value(p.grad) for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
        out["params"].append({n: _value(p) for n, p in model.named_parameters()})
        out["ops"], out["collectives"] = ops.count, collectives.total  # the last step's (static in static mode)
    if mode == "static":
        rt = vescale.static.static_runtime(model)
        out["steps"] = (rt.recorded_steps, rt.static_steps)
        out["kept_eager"] = sorted(vescale.static.eager_modules(model))
    return out


def _both(names: list) -> dict:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    results = {name: {mode: _train(name, mode) for mode in ("eager", "static")} for name in names}
    return results if dist.get_rank() == 0 else None


# Two sets of ranks: the long suite (``pytest -m slow``) adds the models whose layers another
# configuration already covers (tests/conftest.py LONG_SUITE).
MORE = ("hf-llama", "qwen3-moe")


@functools.cache
def _results(names: tuple) -> dict:
    return run_on_ranks(_both, 4, list(names), timeout=900)[0]


@pytest.mark.multiproc
@pytest.mark.parametrize("name", [n for n in CONFIGS if n not in MORE])
def test_static_steps_equal_eager_steps_bit_for_bit(name):
    _check(name, _results(tuple(n for n in CONFIGS if n not in MORE))[name])


@pytest.mark.multiproc
@pytest.mark.parametrize("name", MORE)
def test_more_static_steps_equal_eager_steps_bit_for_bit(name):
    _check(name, _results(MORE)[name])


def _check(name: str, runs: dict) -> None:
    eager, static = runs["eager"], runs["static"]
    recorded, ran_static = static["steps"]
    assert recorded + ran_static == STEPS and ran_static >= 2, f"{name}: (recorded, static) steps {static['steps']}"
    assert static["ops"] < eager["ops"], f"{name}: a static step dispatched {static['ops']} DTensor ops, eager {eager['ops']}"
    assert static["collectives"] > 0, f"{name}: a static step issued no collective"
    for step in range(STEPS):
        assert torch.equal(static["losses"][step], eager["losses"][step]), (
            f"{name} (kept eager: {static['kept_eager']}): step {step} loss {static['losses'][step].item()!r} "
            f"vs eager {eager['losses'][step].item()!r}")
        for key in ("grads", "params"):
            want, got = eager[key][step], static[key][step]
            assert want.keys() == got.keys(), (name, step, key)
            differ = [n for n in want if not torch.equal(got[n], want[n])]
            assert not differ, (
                f"{name} (kept eager: {static['kept_eager']}): step {step}, {key} differ from eager mode's: "
                + ", ".join(f"{n} by {(got[n] - want[n]).abs().max().item():.3g}" for n in differ[:6]))
