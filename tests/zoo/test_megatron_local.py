"""benchmarks/megatron_local.py and megatron_moe.py, the hand-written baselines of bench_dispatch, train the models.

A baseline that does not compute the model would make every ratio against it meaningless. On gloo
ranks (DP=2 x TP=2 with ZeRO-3, as the bench's dp2tp2; TP=2 alone, as its tp2; DP=2 x TP=2 with
plain data parallelism) from the single-device model's initial weights: the losses of three AdamW
steps match the single-device model's within 1e-5, the first step's gradient shards are the
single-device gradients cut the same way (within 1e-6), the weights are really cut (local shapes),
the collectives per step are exactly the hand-written schedule's (counted), and ZeRO-3's gathered
buffers are freed after the step. The MoE one (HF Mixtral, TP=2 + SP) the same way, last.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib

import pytest
import torch
import torch.distributed as dist

import vescale
from vescale.debug import CollectiveCounter
from vescale.testing import run_on_ranks
from vescale.zoo import LlamaConfig, LlamaForCausalLM, synthetic_batches

PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "megatron_local.py"
CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
BATCH, SEQ, STEPS, LR = 4, 8, 3, 1e-2
LOSS_TOL, GRAD_TOL = 1e-5, 1e-6


def _module():
    spec = importlib.util.spec_from_file_location("megatron_local", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _batches():
    return synthetic_batches(STEPS, BATCH, SEQ, CONFIG.vocab_size, seed=3)


@functools.cache
def _single():
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, first_grads = [], None
    for ids, labels in _batches():
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, first_grads


def _expected_grad_shards(mod, mesh, zero3, grads):
    """The single-device gradients laid out as this rank's shards: a model whose weights are those
    gradients, cut by the same code (its forward checks the layout against single device)."""
    holder = LlamaForCausalLM(CONFIG)
    with torch.no_grad():
        for n, p in holder.named_parameters():
            p.copy_(grads[n])
    return [s.detach().clone() for s in mod.MegatronLlama(holder, mesh, zero3).parameters()]


def _parallel(shape, zero3, first_grads):
    mod = _module()
    mesh = vescale.init_mesh(shape, ("DP", "TP"))
    dp, dp_rank = mesh["DP"].size(), mesh["DP"].get_local_rank()
    expected = _expected_grad_shards(mod, mesh, zero3, first_grads)
    torch.manual_seed(0)
    local = mod.MegatronLlama(LlamaForCausalLM(CONFIG), mesh, zero3)
    opt = torch.optim.AdamW(local.parameters(), lr=LR)
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    losses, grad_err, counts = [], None, None
    for ids, labels in _batches():
        with CollectiveCounter() as counter:
            loss = local(input_ids=ids[rows], labels=labels[rows]).loss
            loss.backward()
        if grad_err is None:
            grad_err = max((s.grad - e).abs().max().item() for s, e in zip(local.parameters(), expected))
            counts = dict(counter.counts)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh["DP"].get_group())  # each DP rank holds its share
        losses.append(total.item())
    layer = local.model.model.layers[0]
    shapes = {"q_proj": tuple(layer.self_attn.q_proj.weight.shape), "o_proj": tuple(layer.self_attn.o_proj.weight.shape),
              "embed": tuple(local.model.model.embed_tokens.weight.shape), "layer_shard": local.layers[0].shard.numel()}
    stored = [unit.full.untyped_storage().size() for unit in local.layers + [local.root]]
    return losses, grad_err, counts, shapes, stored


H, I, V, L = CONFIG.hidden_size, CONFIG.intermediate_size, CONFIG.vocab_size, CONFIG.num_hidden_layers
LAYER_NUMEL = 2 * H + 4 * H * H // 2 + 3 * H * I // 2  # two norms, attention and MLP at TP=2

CASES = {  # name: (mesh shape, zero3, collectives per step, elements of a layer's shard)
    # ZeRO-3: per layer 1 DP all-gather in forward and 1 in backward, 2 SP all-gathers in forward and
    # 2 (reduce-scatter's backward) in backward, + the root's gather, the head's input, the
    # embedding's backward; reduce-scatters mirrored, + 1 DP gradient reduce-scatter per unit;
    # all-reduces: the loss's max / target / sum over TP, the token count over DP, one norm
    # gradient all-reduce over TP per unit.
    "dp2tp2-zero3": ((2, 2), True, {"all_gather": 6 * L + 3, "reduce_scatter": 5 * L + 3, "all_reduce": L + 5},
                     LAYER_NUMEL // 2),
    "tp2": ((1, 2), False, {"all_gather": 4 * L + 2, "reduce_scatter": 4 * L + 2, "all_reduce": L + 4}, LAYER_NUMEL),
    # Plain DP: every unit's gradient all-reduced over DP instead of gathered / reduce-scattered.
    "dp2tp2-ddp": ((2, 2), False, {"all_gather": 4 * L + 2, "reduce_scatter": 4 * L + 2, "all_reduce": 2 * L + 6},
                   LAYER_NUMEL),
}


@pytest.mark.multiproc
@pytest.mark.parametrize("case", list(CASES))
def test_megatron_local_trains_as_single_device(case):
    shape, zero3, want_counts, shard_numel = CASES[case]
    want_losses, first_grads = _single()
    losses, grad_err, counts, shapes, stored = run_on_ranks(_parallel, shape[0] * shape[1], shape, zero3, first_grads)[0]
    assert all(abs(a - b) <= LOSS_TOL for a, b in zip(losses, want_losses)), (losses, want_losses)
    assert want_losses[-1] < want_losses[0]  # the steps train (a frozen model would also "match")
    assert grad_err <= GRAD_TOL
    assert counts == want_counts
    assert shapes == {"q_proj": (H // 2, H), "o_proj": (H, H // 2), "embed": (V // 2, H), "layer_shard": shard_numel}
    # ZeRO-3 frees every gathered buffer once its gradients are reduce-scattered; without it they stay.
    assert (all(n == 0 for n in stored) if zero3 else all(n > 0 for n in stored)), stored


# ---- benchmarks/megatron_moe.py: the hand-written MoE of `bench_dispatch.py --model moe` -----------

def _moe_module():
    import sys

    sys.path.insert(0, str(PATH.parent))  # it builds on megatron_local's collectives
    try:
        spec = importlib.util.spec_from_file_location("megatron_moe", PATH.parent / "megatron_moe.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(PATH.parent))


def _moe_train(model):
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, counts = [], None
    for ids, labels in synthetic_batches(STEPS, BATCH, SEQ, 128, seed=3):
        with CollectiveCounter() as counter:
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
        counts = counts or dict(counter.counts)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, counts


def _moe_parallel(reduce_partial: bool):
    from vescale.zoo import tiny_hf_mixtral

    mod = _moe_module()
    mesh = vescale.init_mesh((1, 2), ("DP", "TP"))
    torch.manual_seed(0)
    local = mod.MegatronMixtral(tiny_hf_mixtral(), mesh)
    if not reduce_partial:
        local._reduce_partial_grads = lambda: None
    losses, counts = _moe_train(local)
    layer = local.model.model.layers[0]
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    return losses, counts, shapes, tuple(local.model.model.embed_tokens.weight.shape)


@pytest.mark.multiproc
def test_megatron_moe_trains_as_single_device():
    """HF Mixtral (the zoo's tiny one) cut over TP=2 with sequence parallelism: three AdamW steps'
    losses within 1e-5 of the single device's, the weights cut (heads, every expert's intermediate
    dim, the vocabulary), the collectives per step the hand-written schedule's; without the
    all-reduce of the norms' and routers' partial gradients the losses part from the single
    device's (what the test would miss if that all-reduce did nothing)."""
    from vescale.zoo import tiny_hf_mixtral

    torch.manual_seed(0)
    single = tiny_hf_mixtral()
    want, _ = _moe_train(single)
    c = single.config
    losses, counts, shapes, embed = run_on_ranks(_moe_parallel, 2, True)[0]
    assert all(abs(a - b) <= LOSS_TOL for a, b in zip(losses, want)), (losses, want)
    assert want[-1] < want[0]
    h, heads, kv, e, i = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.num_local_experts, c.intermediate_size
    d = h // heads
    assert shapes["self_attn.q_proj.weight"] == (heads * d // 2, h) and shapes["self_attn.k_proj.weight"] == (kv * d // 2, h)
    assert shapes["self_attn.o_proj.weight"] == (h, heads * d // 2)
    assert shapes["mlp.experts.gate_up_proj"] == (e, i, h) and shapes["mlp.experts.down_proj"] == (e, h, i // 2)
    assert shapes["mlp.gate.weight"] == (e, h) and embed == (c.vocab_size // 2, h)
    layers = c.num_hidden_layers
    # Per layer 2 SP all-gathers forward + 2 in backward (the reduce-scatters' backward); + the
    # final norm's gather and the first layer's reduce-scatter's backward. Reduce-scatters mirrored.
    # All-reduces: the loss's max / target / sum of exponentials and the partial gradients, once.
    assert counts == {"all_gather": 4 * layers + 2, "reduce_scatter": 4 * layers + 2, "all_reduce": 4}, counts
    unreduced, *_ = run_on_ranks(_moe_parallel, 2, False)[0]
    assert max(abs(a - b) for a, b in zip(unreduced, want)) > 1e-4, (unreduced, want)
