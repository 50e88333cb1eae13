"""Issue 27, defect 3: a vocabulary-parallel embedding without sequence parallelism trains.

HF Qwen2-MoE on TP=2 without SP, its embedding table split by rows (``Shard(0)``: the lookup's
output is DTensor's masked partial, all-reduced where the plan asks for it ``Replicate``), failed in
the first backward with ``AssertionError: Redistribution from one partial type (P(sum)) to another
(MaskP(sum, ...)) is unsupported``: the column-parallel projections reading the embeddings hand
their gradient back ``Partial(sum)``, and the all-reduce's backward tried to move it to the
lookup's masked-partial layout. Both are the same global gradient; it is now handed back as it
arrives (``vescale.comm.moves.grad_placements``) and the lookup's backward gives the table a
``Partial(sum)`` gradient that the gradient reduction reduce-scatters to its rows.

The plan is written from docs/plan.md (attention column/row-parallel, the experts as ``moe_plan``
shards them, the shared expert as an MLP, a vocabulary-parallel head). On 2 gloo ranks, eager and
Static Eager: 3 SGD steps match the single device within 1e-6 (losses, first-step gradients, final
parameters: fp32, only the reduction order of the sharded matmuls and collectives differs), and the
table is really split: each rank holds (and steps) 64 of its 128 rows, its gradient too.
"""

from __future__ import annotations

import functools

import pytest
import torch

import vescale
from vescale import InterleavedShard, Replicate, Shard, VescalePlan
from vescale.testing import global_value, run_on_ranks
from vescale.zoo import synthetic_batches

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.multiproc
STEPS, BATCH, SEQ, VOCAB = 3, 2, 16, 128
LAYER = r"model\.layers\.\d+"


def tiny_qwen2_moe():
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, use_cache=False)
    return transformers.Qwen2MoeForCausalLM(config)


def plan_without_sp() -> VescalePlan:
    plan = VescalePlan()
    plan.shard(r"model\.embed_tokens\.weight", Shard(0), mesh="TP")  # vocabulary-parallel
    plan.shard(r"model\.embed_tokens\.<out>", Replicate(), mesh="TP")  # no SP: all-reduced
    plan.shard(rf"{LAYER}\.self_attn\.<in>[hidden_states]", Replicate(), mesh="TP")
    plan.shard(rf"{LAYER}\.self_attn\.(q|k|v)_proj\.(weight|bias)", Shard(0), mesh="TP")
    plan.shard(rf"{LAYER}\.self_attn\.o_proj\.weight", Shard(1), mesh="TP")
    plan.shard(rf"{LAYER}\.self_attn\.<out>", Replicate(), mesh="TP")
    plan.shard(rf"{LAYER}\.mlp\.<in>", Replicate(), mesh="TP")
    plan.shard(rf"{LAYER}\.mlp\.experts\.gate_up_proj", InterleavedShard(1, 2), mesh="TP")
    plan.shard(rf"{LAYER}\.mlp\.experts\.down_proj", Shard(2), mesh="TP")
    plan.shard(rf"{LAYER}\.mlp\.shared_expert\.(gate|up)_proj\.weight", Shard(0), mesh="TP")
    plan.shard(rf"{LAYER}\.mlp\.shared_expert\.down_proj\.weight", Shard(1), mesh="TP")
    plan.shard(rf"{LAYER}\.mlp\.<out>", Replicate(), mesh="TP")
    plan.shard(r"lm_head\.<in>", Replicate(), mesh="TP")
    plan.shard(r"lm_head\.weight", Shard(0), mesh="TP")
    plan.shard(r"lm_head\.<out>", Shard(-1), mesh="TP")
    return plan


def _train(model) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads, table = [], None, None
    for input_ids, labels in synthetic_batches(STEPS, BATCH, SEQ, VOCAB, seed=5):
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        if grads is None:
            grads = {n: global_value(p.grad) for n, p in model.named_parameters()}
            w = model.model.embed_tokens.weight
            table = (tuple(w.to_local().shape), tuple(w.grad.to_local().shape)) if hasattr(w, "to_local") else None
        opt.step()
        opt.zero_grad()
        losses.append(global_value(loss).item())
    return {"losses": losses, "grads": grads, "params": {n: global_value(p) for n, p in model.named_parameters()},
            "table": table}


@functools.cache
def _single_device() -> dict:
    return _train(tiny_qwen2_moe())


def _distributed(mode: str) -> dict:
    mesh = vescale.init_mesh((2,), ("TP",))
    model = tiny_qwen2_moe()
    vescale.parallelize(model, plan_without_sp(), mesh, mode=mode)
    return _train(model)


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_qwen2_moe_vocabulary_parallel_embedding_without_sp(mode):
    want = _single_device()
    for got in run_on_ranks(_distributed, 2, mode):
        assert got["table"] == ((VOCAB // 2, 32), (VOCAB // 2, 32))
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), atol=1e-6, rtol=0)
        for kind in ("grads", "params"):
            for name, value in want[kind].items():
                torch.testing.assert_close(got[kind][name], value, atol=1e-6, rtol=0, msg=f"{kind} {name}")
