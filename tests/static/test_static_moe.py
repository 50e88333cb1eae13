"""Static Eager mode on HF Mixtral (and Qwen3-MoE on TP=2 + SP; unchanged, default ``grouped_mm`` experts kernel) under
``vescale.zoo.moe_plan``: the same losses and gradients as eager mode and the single device, with the
MoE blocks (router, experts and the block's own ops) running on local tensors in every config (the
test fails if any of them is kept eager).

* TP=2 + SP (tensor-parallel experts, ``InterleavedShard`` gate|up): the routing's data-dependent
  ops act on replicated tokens and the experts' matmuls on local shards. In backward the router's
  and the experts' gradients are partial sums over TP: autograd's gradients of the token gather
  (``IndexBackward0``) and of the router's top-k (``TopkBackward0``) go into zeros they make
  themselves, which DTensor takes Replicate -> Partial (zeros / n: zeros), and the router's softmax
  backward keeps its gradient Partial (``vescale.dispatch.fast.partial``), so the block adds the two
  input gradients as local tensors of one layout. (Before that strategy the router stayed eager and
  ``moe_plan`` kept the blocks on DTensors: a static block then added a replicated and a Partial
  gradient as local tensors, ~5e-4 off.)
* DP=2 + ZeRO-3 and DP=2 x TP=2 + SP + ZeRO-3: ``moe_plan`` makes the MoE blocks batch-local
  (``plan.batch_local``): each DP rank's block runs on its own tokens, on the TP sub-mesh, and in
  every config the experts see the DP rank's tokens only.
* Nothing stays eager: HF's model body (which reads the sequence length from the embeddings: the
  plan hands it them whole and splits the sequence at the first layer; under DP its mask code
  expands the plain position ids to the batch size it reads there, given the global one back:
  ``vescale.static.local_sizes.GlobalSizes``) and the root (whose loss views the
  vocabulary-sharded logits with the config's vocabulary size, rewritten to the local one) run
  static too.

Losses within 1e-5 of the single device and of eager mode over 4 SGD steps, and the last step's
gradients within 1e-5 (fp32: sharded matmuls and collectives sum in another order, and a static step
reduces some gradients at module boundaries where eager mode reduces their sum once, which moves the
loss by about 1e-6).
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from torch.distributed.tensor import DTensor

import vescale
from vescale.testing import run_on_ranks
from vescale.zoo import moe_plan, synthetic_batches, tiny_hf_mixtral, tiny_hf_qwen3_moe

STEPS, LR, TOL = 4, 0.05, 1e-5
BATCH, SEQ = 4, 16
EXPERTS = ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")


def _train(model) -> tuple[list[float], dict]:
    """Losses of every step and the gradients of the last one (gathered)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step, (input_ids, labels) in enumerate(synthetic_batches(STEPS, BATCH, SEQ, 128, seed=1)):
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        if step == STEPS - 1:
            grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


def _run(shape, names, zero3: bool, build=tiny_hf_mixtral) -> dict:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    out = {}
    torch.manual_seed(0)
    out["single"] = _train(build())  # the MoE models' defaults draw no random numbers in training
    mesh = vescale.init_mesh(shape, names)
    for mode in ("eager", "static"):
        torch.manual_seed(0)
        model = build()
        plan = moe_plan(mesh, model.config, sequence_parallel="TP" in names, zero3=zero3)
        vescale.parallelize(model, plan, mesh, mode=mode)
        rows = out[f"{mode}_rows"] = set()  # tokens the experts get, as local tensors in static steps
        model.get_submodule(EXPERTS[0]).register_forward_pre_hook(lambda m, a: rows.add(tuple(a[0].shape)))
        out[mode] = _train(model)
        if mode == "static":
            rt = vescale.static.static_runtime(model)
            out["static_steps"] = rt.static_steps
            out["eager_modules"] = sorted(vescale.static.eager_modules(model))
    return out


CONFIGS = {  # id: (ranks, mesh shape, mesh names, ZeRO-3, model)
    "TP=2+SP": (2, (2,), ("TP",), False, tiny_hf_mixtral),
    "DP=1xTP=2+SP": (2, (1, 2), ("DP", "TP"), False, tiny_hf_mixtral),  # TP-only training's mesh: a size-1 DP dim
    "DP=2+ZeRO-3": (2, (2,), ("DP",), True, tiny_hf_mixtral),
    "DP=2xTP=2+SP+ZeRO-3": (4, (2, 2), ("DP", "TP"), True, tiny_hf_mixtral),
    "Qwen3-MoE TP=2+SP": (2, (2,), ("TP",), False, tiny_hf_qwen3_moe),  # per-head q/k norms, its own router
}


@functools.cache
def _results(config: str):
    ranks, shape, names, zero3, build = CONFIGS[config]
    return run_on_ranks(_run, ranks, shape, names, zero3, build)[0]


@pytest.mark.multiproc
@pytest.mark.parametrize("config", list(CONFIGS))
def test_static_moe_matches_eager_and_single_device(config):
    r = _results(config)
    assert r["static_steps"] >= STEPS - 2, r["static_steps"]
    (single, single_grads), (eager, eager_grads), (static, static_grads) = r["single"], r["eager"], r["static"]
    for step, (s, e, one) in enumerate(zip(static, eager, single)):
        assert abs(s - one) <= TOL, f"step {step}: static {s} vs single device {one}"
        assert abs(s - e) <= TOL, f"step {step}: static {s} vs eager {e}"
    for mode, grads in (("eager", eager_grads), ("static", static_grads)):
        diff, where = max(((grads[n] - g).abs().max().item(), n) for n, g in single_grads.items())
        assert diff <= TOL, f"{mode}: last step's gradient of {where} differs from single device by {diff:.3g}"
    kept = set(r["eager_modules"])
    assert not kept & set(EXPERTS), f"experts kept eager: {r['eager_modules']}"
    dp = 2 if "DP=2" in config else 1
    for mode in ("eager", "static"):  # each DP rank's experts see its own tokens only
        assert r[f"{mode}_rows"] == {(BATCH * SEQ // dp, 32)}, (mode, r[f"{mode}_rows"])
    # Nothing at all: HF's body and root run static too (moe_plan / llama_plan), under DP as well.
    assert not kept, f"modules kept eager: {r['eager_modules']}"


def _relabels(relabels: bool) -> dict:
    """DP=2 x TP=2 + SP + ZeRO-3 static steps with the batch-local MoE blocks' hooks replaced by
    precompiled relabels (``vescale.static.relabel``) or run (the runtime's ``_find_relabelled`` finding none, in this test); the last step has
    a new sequence length (a derived record: its relabels settle their sizes at the first call)."""
    from vescale.debug import CollectiveCounter
    from vescale.parallel import batch_local

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
    torch.manual_seed(0)
    model = tiny_hf_mixtral()
    vescale.parallelize(model, moe_plan(mesh, model.config, sequence_parallel=True, zero3=True), mesh, mode="static")
    rt = vescale.static.static_runtime(model)
    if not relabels:  # the reference path: static steps run the batch-local modules' hooks
        rt._find_relabelled = lambda rec: frozenset()
    conversions = [0]  # the scopes' DTensor conversions (inputs, parameters), forward
    to_sub = batch_local._ToSub.forward
    batch_local._ToSub.forward = lambda *a: conversions.__setitem__(0, conversions[0] + 1) or to_sub(*a)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = {"losses": [], "grads": [], "collectives": [], "conversions": []}
    batches = list(synthetic_batches(STEPS, BATCH, SEQ, 128, seed=1)) + list(synthetic_batches(1, BATCH, SEQ - 4, 128, seed=2))
    try:
        for input_ids, labels in batches:
            conversions[0], counter = 0, CollectiveCounter()
            with counter:
                loss = model(input_ids=input_ids, labels=labels).loss
                loss.backward()
            out["losses"].append(loss.full_tensor().item())
            out["grads"].append({n: p.grad.full_tensor().clone() for n, p in model.named_parameters()})
            out["collectives"].append(dict(counter.counts))
            out["conversions"].append(conversions[0])
            opt.step()
            opt.zero_grad()
    finally:
        batch_local._ToSub.forward = to_sub
    rec = next(r for r in rt.records.values() if r.resized_from is None)
    out["relabelled"] = sorted(rec.relabelled)
    out["derived_relabelled"] = [sorted(r.relabelled) for r in rt.records.values() if r.resized_from is not None]
    out["quiet"] = sorted(p for p in rec.quiet or {} if p.endswith((".mlp.gate", ".mlp.experts")))  # those with parameters
    out["derived"] = rt.resized_records
    out["export"] = vescale.static.export_plan(model)
    return out


@pytest.mark.multiproc
def test_batch_local_blocks_run_as_relabels_in_static_steps():
    """The batch-local MoE blocks of a static step: no DTensor conversion of their hooks runs (their
    inputs, outputs and parameters relabelled by precompiled moves), the router and experts are quiet
    (no hooks), and losses, gradients and collectives are those of the steps that run the hooks, bit
    for bit; a new sequence length (derived record) relabels too, and matches too."""
    fast, hooks = run_on_ranks(lambda: (_relabels(True), _relabels(False)), 4)[0]
    blocks = ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert fast["relabelled"] == blocks and hooks["relabelled"] == []
    assert fast["quiet"] == [f"{b}.{m}" for b in blocks for m in ("experts", "gate")] and hooks["quiet"] == []
    assert fast["derived"] == hooks["derived"] == 1
    # HF's body runs static under DP: its mask code's expand of the plain position ids to the batch
    # size read from the embeddings (this rank's 2 of 4 rows) gets the global size back.
    assert "module 'model', sized call #0 on a plain tensor: static steps pass the global (4, *) for (2, *)" in fast["export"]
    # Recording, then static steps: the first static step checks shapes, then the blocks run quiet.
    assert all(n > 0 for n in hooks["conversions"]) and fast["conversions"][0] == hooks["conversions"][0]
    assert fast["conversions"][1:STEPS] == [0] * (STEPS - 1), fast["conversions"]
    assert fast["conversions"][STEPS] == 0 < hooks["conversions"][STEPS]  # the derived record's step
    assert fast["derived_relabelled"] == [blocks] and hooks["derived_relabelled"] == [[]]
    assert fast["collectives"] == hooks["collectives"]
    for step, (a, b) in enumerate(zip(fast["losses"], hooks["losses"])):
        assert a == b, f"step {step}: {a} vs {b}"
    for step, (ga, gb) in enumerate(zip(fast["grads"], hooks["grads"])):
        for n, g in ga.items():
            assert torch.equal(g, gb[n]), f"step {step}: gradient of {n}"
