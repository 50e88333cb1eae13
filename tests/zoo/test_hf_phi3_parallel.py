"""Issue 27, defect 4, end to end: HF Phi-3's attention really runs sharded under TP.

Phi-3 fuses q|k|v into ``qkv_proj`` and cuts them out with ``qkv[..., :pos]`` slices; gate|up into
``gate_up_proj``, cut with ``chunk(2)``. A plan written from docs/plan.md shards them
``InterleavedShard(0, 3)`` and ``InterleavedShard(0, 2)``. DTensor's slice rule gathered the
interleaved dim, so attention ran replicated on every TP rank while the losses matched; now the
slices stay local (``vescale.dispatch.fast.interleaved``; in Static Eager mode the slices get local
bounds, ``vescale.static.local_sizes``).

On 2 gloo ranks, eager and Static Eager: 3 SGD steps match the single device within 1e-6 (losses,
first-step gradients, final parameters: fp32, only the reduction order of the row-parallel matmuls
differs), ``o_proj`` takes a local (2, 16, 16) input (half the heads; (2, 16, 32) on one device) in
every step, and ``vescale.debug.gathers`` finds no op gathering a sharded input in the forward
(it named ``self_attn``'s three ``aten.slice`` calls before; in backward, at these tiny sizes,
DTensor's cost search gathers the row-parallel weights rather than all-reduce the Partial gradient
that reaches them without SP, which it reports too). In Static Eager mode attention runs static.
"""

from __future__ import annotations

import functools

import pytest
import torch

import vescale
from vescale.debug import gathers
from vescale import InterleavedShard, Replicate, Shard, VescalePlan
from vescale.testing import global_value, run_on_ranks
from vescale.zoo import synthetic_batches

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.multiproc
STEPS, BATCH, SEQ, VOCAB = 3, 2, 16, 128
LAYER = r"model\.layers\.\d+"


def tiny_phi3():
    torch.manual_seed(0)
    config = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, use_cache=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    return transformers.Phi3ForCausalLM(config)


def phi3_plan() -> VescalePlan:
    plan = VescalePlan()
    plan.shard(rf"{LAYER}\.self_attn\.<in>[hidden_states]", Replicate(), mesh="TP")
    plan.shard(rf"{LAYER}\.self_attn\.qkv_proj\.weight", InterleavedShard(0, 3), mesh="TP")  # q | k | v
    plan.shard(rf"{LAYER}\.self_attn\.o_proj\.weight", Shard(1), mesh="TP")
    plan.shard(rf"{LAYER}\.self_attn\.<out>", Replicate(), mesh="TP")
    plan.shard(rf"{LAYER}\.mlp\.<in>", Replicate(), mesh="TP")
    plan.shard(rf"{LAYER}\.mlp\.gate_up_proj\.weight", InterleavedShard(0, 2), mesh="TP")  # gate | up
    plan.shard(rf"{LAYER}\.mlp\.down_proj\.weight", Shard(1), mesh="TP")
    plan.shard(rf"{LAYER}\.mlp\.<out>", Replicate(), mesh="TP")
    return plan


def _train(model, report: bool = False) -> dict:
    shapes = []
    model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(
        lambda m, args: shapes.append(tuple((args[0]._local_tensor if hasattr(args[0], "_local_tensor") else args[0]).shape)))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads, gathered = [], None, None
    for step, (input_ids, labels) in enumerate(synthetic_batches(STEPS, BATCH, SEQ, VOCAB, seed=7)):
        if report and step == 0:
            with gathers(model) as found:
                loss = model(input_ids=input_ids, labels=labels).loss
                loss.backward()
            gathered = sorted(str(g) for g in found.counts if g.phase == "forward")
        else:
            loss = model(input_ids=input_ids, labels=labels).loss
            loss.backward()
        if grads is None:
            grads = {n: global_value(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(global_value(loss).item())
    return {"losses": losses, "grads": grads, "params": {n: global_value(p) for n, p in model.named_parameters()},
            "o_proj_inputs": shapes, "gathered": gathered}


@functools.cache
def _single_device() -> dict:
    return _train(tiny_phi3())


def _distributed(mode: str) -> dict:
    mesh = vescale.init_mesh((2,), ("TP",))
    model = tiny_phi3()
    vescale.parallelize(model, phi3_plan(), mesh, mode=mode)
    out = _train(model, report=True)
    out["eager_modules"] = vescale.static.eager_modules(model) if mode == "static" else {}
    return out


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_phi3_attention_runs_sharded_and_trains_as_one_device(mode):
    want = _single_device()
    assert set(want["o_proj_inputs"]) == {(BATCH, SEQ, 32)}
    for got in run_on_ranks(_distributed, 2, mode):
        assert got["o_proj_inputs"] == [(BATCH, SEQ, 16)] * STEPS  # half the heads on each rank, every step
        assert got["gathered"] == [], got["gathered"]
        assert not any("self_attn" in path for path in got["eager_modules"]), got["eager_modules"]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), atol=1e-6, rtol=0)
        for kind in ("grads", "params"):
            for name, value in want[kind].items():
                torch.testing.assert_close(got[kind][name], value, atol=1e-6, rtol=0, msg=f"{kind} {name}")
