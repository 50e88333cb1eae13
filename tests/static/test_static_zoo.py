"""Static Eager mode on the zoo's other unchanged models: HF ``GPT2LMHeadModel`` (``gpt2_plan``) and
diffusers' ``DiTTransformer2DModel`` (``dit_plan``), on DP=2 and on TP=2, against one device.

Each model reads a global size somewhere a sharded module would see a local one (DiT's attention
views with the global head count but a head size it computes from the local width; both models
expand position ids or embeddings to the batch they read from the DP-split input); the zoo plans
keep exactly those modules on DTensors (``plan.eager``), so ``mode="static"`` works on the models
unchanged. GPT-2's Conv1D views its output with its global width and its attention splits q|k|v
with the global ``split_size``, which static steps rewrite to the local sizes
(``vescale.static.local_sizes``): its ``c_fc`` is the probe below, and on TP neither it, ``c_attn``
nor attention stays eager (the row-parallel ``c_proj`` does: its bias added to a partial sum needs
DTensor). Checked: 3 steps with dropout
on, the loss at each step within 1e-5 of one device (fp32 sums in another order), the last steps
ran static, and a module the plan leaves static ran on plain local tensors of its shard's shape.

The causal LMs (GPT-2, and the zoo LLaMA with dropout on its residual branches and attention) run
their steps inside ``vescale.random.consistent()`` on the mesh as on one device, as a user's shared
training script would. That once made static steps draw wrong masks: the mode handled the DTensor
random ops of the recording step itself, so the recording never saw which modules draw, and their
static bodies drew as if their local shard were the whole tensor (~5e-3 off from the first static
step).
"""

from __future__ import annotations

import logging

import pytest
import torch

import vescale
from vescale.testing import run_on_ranks
from vescale.zoo import dit_plan, gpt2_plan, llama_plan, synthetic_batches, tiny_dit, tiny_hf_gpt2, tiny_llama

STEPS, TOL = 4, 1e-5


def _causal_lm_steps(model):
    for step, (input_ids, labels) in enumerate(synthetic_batches(STEPS, 4, 16, 128, seed=1)):
        vescale.manual_seed(100 + step)
        with vescale.random.consistent():
            yield model(input_ids=input_ids, labels=labels).loss


def _dit_steps(model):
    g = torch.Generator().manual_seed(1)
    x, t, c, target = (torch.randn(4, 4, 8, 8, generator=g), torch.randint(0, 1000, (4,), generator=g),
                       torch.randint(0, 10, (4,), generator=g), torch.randn(4, 4, 8, 8, generator=g))
    for _ in range(STEPS):
        yield ((model(x, timestep=t, class_labels=c).sample - target) ** 2).mean()


# name: (builder, plan, steps, a module the plan leaves static: its output's local shape on TP=2 / DP=2)
MODELS = {
    # c_fc: a Conv1D, which views its output with its global width (static steps pass the local one)
    "gpt2": (tiny_hf_gpt2, gpt2_plan, _causal_lm_steps, "transformer.h.0.mlp.c_fc", {"TP": (4, 16, 128), "DP": (2, 16, 256)}),
    "llama": (lambda: tiny_llama(hidden_dropout=0.1, attention_dropout=0.1), llama_plan, _causal_lm_steps,
              "model.layers.0.mlp.act_fn", {"TP": (4, 16, 64), "DP": (2, 16, 128)}),
    "dit": (tiny_dit, dit_plan, _dit_steps, "transformer_blocks.0.ff.net.0.proj", {"TP": (4, 16, 64), "DP": (2, 16, 128)}),
}


def _train(name: str, dim: str | None):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    build, plan, steps, probe, _ = MODELS[name]
    vescale.manual_seed(0)
    torch.manual_seed(0)
    model = build()
    seen = []
    if dim is not None:
        mesh = vescale.init_mesh((2,), (dim,))
        vescale.parallelize(model, plan(mesh, model.config), mesh, mode="static")
        model.get_submodule(probe).register_forward_hook(lambda m, a, out: seen.append((type(out).__name__, tuple(out.shape))))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for loss in steps(model):
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    static_steps = vescale.static.static_runtime(model).static_steps if dim is not None else 0
    eager = sorted(vescale.static.eager_modules(model)) if dim is not None else None
    return losses, static_steps, seen[-1] if seen else None, eager


@pytest.mark.multiproc
@pytest.mark.parametrize("dim", ["DP", "TP"])
@pytest.mark.parametrize("name", list(MODELS))
def test_zoo_model_runs_static_and_matches_one_device(name, dim):
    ref, _, _, _ = _train(name, None)
    losses, static_steps, probe_out, eager = run_on_ranks(_train, 2, name, dim)[0]
    assert static_steps >= 1, "no step ran static"
    for step, (a, b) in enumerate(zip(losses, ref)):
        assert abs(a - b) <= TOL, f"{name} {dim}=2: step {step} loss {a} vs one device {b}"
    assert probe_out == ("Tensor", MODELS[name][4][dim]), f"{MODELS[name][3]} ran on {probe_out}"
    assert MODELS[name][3] not in eager, f"{MODELS[name][3]} kept eager: {eager}"
    if name == "gpt2" and dim == "TP":  # Conv1D's global width and attention's global split size: rewritten
        assert not {"transformer.h.0.attn", "transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_fc"} & set(eager), eager
    if name == "gpt2" and dim == "DP":  # its position ids expanded to the global batch: the body runs static
        assert eager == [], eager
