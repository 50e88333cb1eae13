"""Mixed precision (``vescale.MixedPrecision``): the single-device policy (``apply_mixed_precision``)
and the parallel run with the same policy under DP=2 x TP=2 + SP + ZeRO-3 (eager with bucketed and
per-tensor reduction, Static Eager), dropout on.

What is checked:
* one device: modules compute with bf16 parameters, the masters, their gradients and AdamW's state
  stay fp32, outputs are cast to ``output_dtype``;
* parallel: per-step losses within ``TOL`` of the single-device policy run; modules compute with
  bf16 weights and activations (a policy silently not applied fails here: losses cannot tell); masters, gradients and optimizer state
  fp32; the ZeRO-3 gathers move bf16 and every gradient reduce-scatter / all-reduce runs in the
  reduce dtype (the dtypes the collectives receive, ``CollectiveCounter.dtypes``); the split (local
  shapes, a DP rank's share of the batch); a checkpoint saves the fp32 masters and loads them back
  bit for bit into a fresh model with the policy.

CI cost: three 4-rank runs of a few steps of the tiny LLaMA, ~20 s on two cores.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import vescale
from vescale.debug import CollectiveCounter
from vescale.random import consistent
from vescale.testing import error_of, run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_llama

from tests.split_checks import check_llama_split, probe_batch

POLICY = vescale.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
STEPS, SEED = 4, 7
# Per-step loss bound against the single-device policy run. bf16 keeps 8 significant bits: the
# parallel run rounds in other places than one device does (each TP rank's row-parallel partial sum
# and each DP rank's weight-gradient share is rounded to bf16 before it is reduced; one device
# rounds the whole sum once), so activations differ by about one bf16 ulp (2^-8 relative) here and
# there, and AdamW's normalised steps carry that into the weights. Measured over these 4 steps: at
# most 2.1e-4 (the loss averages 60 tokens' errors); the bound leaves a 5x margin. (The fp32 run is
# as close to the bf16 one: equal losses cannot show the policy ran, so the test checks dtypes.)
TOL = 1e-3


def _model():
    torch.manual_seed(0)
    return tiny_llama(attention_dropout=0.1, hidden_dropout=0.1)


def _train(model) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for input_ids, labels in synthetic_batches(STEPS, 4, 16, 128, seed=1):
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append((loss.full_tensor() if isinstance(loss, DTensor) else loss).item())
    return losses


@functools.cache
def _single_device(policy: vescale.MixedPrecision | None) -> list[float]:
    model = _model()
    if policy is not None:
        vescale.apply_mixed_precision(model, policy)
    vescale.manual_seed(SEED)
    with consistent():
        return _train(model)


def test_policy_checks_its_dtypes():
    assert "floating-point" in error_of(vescale.MixedPrecision, torch.int32)
    wrong = functools.partial(vescale.parallelize, mixed_precision=torch.bfloat16)
    assert "vescale.MixedPrecision" in error_of(wrong, _model(), vescale.VescalePlan(), None, kind=TypeError)


def test_single_device_policy_computes_in_param_dtype_and_keeps_fp32_masters():
    model = vescale.apply_mixed_precision(_model(), vescale.MixedPrecision(torch.bfloat16, output_dtype=torch.float32))
    seen = []
    q_proj = model.model.layers[0].self_attn.q_proj
    q_proj.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))  # runs after the cast
    q_proj.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    input_ids, labels = synthetic_batches(1, 2, 8, 128, seed=1)[0]
    out = model(input_ids=input_ids, labels=labels)
    assert seen == [torch.bfloat16, torch.bfloat16]  # the module computed with its bf16 cast
    assert out.logits.dtype == torch.float32  # output_dtype
    out.loss.backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    for name, p in model.named_parameters():
        assert p.dtype == p.grad.dtype == torch.float32, name
        assert all(s.dtype == torch.float32 for s in opt.state[p].values() if s.dim()), name
    assert type(model.model.layers[0].self_attn.q_proj.weight) is torch.nn.Parameter  # the master is back
    assert "already" in error_of(vescale.apply_mixed_precision, model, POLICY)


def _parallel(mode: str, bucketed: bool, ckpt_dir: str | None):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
    kw = {} if bucketed else {"bucket_mb": None}

    def build():
        model = _model()
        plan = llama_plan(mesh, model.config, sequence_parallel=True, zero3=True)
        return vescale.parallelize(model, plan, mesh, mode=mode, mixed_precision=POLICY, **kw)

    model = build()
    vescale.manual_seed(SEED)
    losses = _train(model)
    out = {"losses": losses}
    seen = []  # what the modules compute with (pre-hooks registered last run after the casts)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "model.norm"):
        model.get_submodule(name).register_forward_pre_hook(lambda m, args: seen.append((m.weight.dtype, args[0].dtype)))
    with CollectiveCounter() as counter:  # one more step: the dtypes its collectives received
        input_ids, labels = synthetic_batches(1, 4, 16, 128, seed=2)[0]
        model(input_ids=input_ids, labels=labels).loss.backward()
    out["collectives"] = dict(counter.dtypes)
    out["computed_in"] = set(seen)
    out["dtypes"] = {n: (p.dtype, p.grad.dtype, p.to_local().dtype) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    check_llama_split(model, probe_batch(), tp=2, dp=2, sequence_parallel=True, zero3=True, label=f"{mode}")
    if ckpt_dir is not None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(input_ids=input_ids, labels=labels).loss.backward()
        opt.step()
        vescale.checkpoint.save(ckpt_dir, model, opt, step=1)
        fresh = build()
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        vescale.checkpoint.load(ckpt_dir, fresh, fresh_opt)
        out["ckpt"] = all(
            q.dtype == torch.float32 and torch.equal(p.to_local(), q.to_local())
            for p, q in zip(model.parameters(), fresh.parameters())
        ) and all(
            s.dtype == torch.float32 and torch.equal(s.to_local(), fresh_opt.state[q][k].to_local())
            for p, q in zip(model.parameters(), fresh.parameters())
            for k, s in opt.state[p].items() if k != "step"
        )
        from torch.distributed.checkpoint import FileSystemReader  # what the files hold

        meta = FileSystemReader(str(vescale.checkpoint.latest(ckpt_dir))).read_metadata()
        out["saved"] = {k: m.properties.dtype for k, m in meta.state_dict_metadata.items()
                        if k.startswith("model.") and hasattr(m, "properties")}
    return out if dist.get_rank() == 0 else out["dtypes"]


@pytest.mark.multiproc
@pytest.mark.parametrize("mode,bucketed", [("eager", True), ("eager", False), ("static", True)])
def test_parallel_policy_matches_the_single_device_policy(mode, bucketed, tmp_path):
    ckpt = str(tmp_path / "ckpt") if (mode, bucketed) == ("eager", True) else None
    results = run_on_ranks(_parallel, 4, mode, bucketed, ckpt)
    ref = _single_device(POLICY)
    out = results[0]
    diff = max(abs(a - b) for a, b in zip(out["losses"], ref))
    assert diff <= TOL, (mode, bucketed, out["losses"], ref)
    # Losses cannot show the policy was applied (the fp32 run is as close), so: modules computed
    # with bf16 weights on bf16 activations (a ZeRO-3 gathered copy, a TP shard, a replicated norm).
    assert out["computed_in"] == {(torch.bfloat16, torch.bfloat16)}, out["computed_in"]
    for rank_dtypes in [out["dtypes"], *results[1:]]:
        for name, dtypes in rank_dtypes.items():
            assert dtypes == (torch.float32,) * 3, (name, dtypes)  # masters, grads, local shards
    kinds = out["collectives"]
    # ZeRO-3 gathers move bf16 (the cast shard); DTensor's TP/SP collectives move bf16 activations.
    assert kinds.get(("all_gather", torch.bfloat16), 0) >= 3 and ("all_gather", torch.float32) not in kinds, kinds
    # Gradients are reduced in fp32 (reduce_dtype): every reduce-scatter is fp32 (activations'
    # reduce-scatters under SP are bf16 and go through DTensor, counted apart below).
    assert kinds.get(("reduce_scatter", torch.float32), 0) >= 1, kinds
    if ckpt is not None:
        assert out["ckpt"], "checkpoint round trip changed the fp32 masters or optimizer state"
        assert out["saved"] and set(out["saved"].values()) == {torch.float32}, out["saved"]
