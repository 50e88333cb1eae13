"""HF Mixtral and Qwen3-MoE, unchanged, under ``vescale.zoo.moe_plan``: single-device equivalence.

Each configuration trains 5 AdamW steps from the single-device initial weights on the same global
batches and must match the single-device run of the same model and experts kernel:

* loss at every step, gradients after the first backward and gathered final parameters within
  1e-5 (fp32; only the order of floating-point sums differs: sharded matmuls, collectives, and
  under EP the per-token sum over its experts);
* local shapes *and values* of the expert tensors: tensor-parallel ``gate_up_proj`` holds this rank's
  slice of the gate half and of the up half (``InterleavedShard(1, 2)``), ``down_proj`` its columns;
  expert-parallel ranks hold whole experts E/EP at a time; ZeRO-3 stores 1/DP of the experts (with
  EP: 1/DP of the rank's E/EP experts);
* without EP, the experts module of each rank gets that DP rank's tokens only (``plan.batch_local``,
  which ``moe_plan`` states for the MoE blocks under DP): batch x sequence / DP rows.

A fourth check trains Mixtral eagerly over a new sequence length at every other step (8, 12, 8, 20;
TP=2 + SP and DP=2 + ZeRO-3): losses and final parameters within 1e-5 of the single device, the new
lengths served by the shape-free cache's replayed decisions (hit counts), the experts split.

Kernels: the models' default (``grouped_mm``) everywhere, plus ``eager`` and ``batched_mm`` on the
2-rank TP / EP meshes and ``eager`` on DP=2. Attention is the models' default too (SDPA, run head-parallel by vescale.dispatch).
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import vescale
from vescale.testing import run_on_ranks
from vescale.zoo import moe_plan, synthetic_batches, tiny_hf_mixtral, tiny_hf_qwen3_moe

STEPS, LR, TOL = 5, 1e-3, 1e-5
BATCH, SEQ = 4, 8
MODELS = {"mixtral": tiny_hf_mixtral, "qwen3_moe": tiny_hf_qwen3_moe}
EXPERTS = "model.layers.0.mlp.experts"

# (model, experts kernel (None: the model's default), name, mesh shape, mesh names, zero3)
CONFIGS_2 = [
    ("mixtral", None, "TP=2", (2,), ("TP",), False),
    ("mixtral", "eager", "TP=2", (2,), ("TP",), False),
    ("mixtral", "batched_mm", "TP=2", (2,), ("TP",), False),
    ("qwen3_moe", None, "TP=2", (2,), ("TP",), False),
    ("mixtral", None, "EP=2", (2,), ("EP",), False),
    ("mixtral", "eager", "EP=2", (2,), ("EP",), False),
    ("mixtral", "batched_mm", "EP=2", (2,), ("EP",), False),
    ("qwen3_moe", None, "EP=2", (2,), ("EP",), False),
    ("mixtral", None, "DP=2+ZeRO-3", (2,), ("DP",), True),
    ("mixtral", "eager", "DP=2+ZeRO-3", (2,), ("DP",), True),
]
CONFIGS_4 = [
    ("mixtral", None, "DP=2xTP=2+SP+ZeRO-3", (2, 2), ("DP", "TP"), True),
    ("qwen3_moe", None, "DP=2xTP=2+ZeRO-3", (2, 2), ("DP", "TP"), True),
    ("mixtral", None, "DP=2xEP=2+ZeRO-3", (2, 2), ("DP", "EP"), True),
]


def _build(model_name: str, kernel: str | None):
    torch.manual_seed(0)
    kwargs = {}
    if kernel is not None:
        kwargs["experts_implementation"] = kernel
    return MODELS[model_name](**kwargs)


def _value(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(model) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, first_grads = [], None
    for input_ids, labels in synthetic_batches(STEPS, BATCH, SEQ, 128, seed=1):
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        if first_grads is None:
            first_grads = {n: _value(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(_value(loss).item())
    return {"losses": losses, "grads": first_grads, "params": {n: _value(p) for n, p in model.named_parameters()}}


@functools.cache
def _single_device(model_name: str, kernel: str | None) -> dict:
    model = _build(model_name, kernel)
    assert model.config._experts_implementation == (kernel or "grouped_mm")  # HF's default is grouped_mm
    init = {n: _value(p) for n, p in model.named_parameters() if n.startswith(EXPERTS)}
    return {**_train(model), "init": init}


def _distributed(configs):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    results = {}
    for model_name, kernel, name, shape, names, zero3 in configs:
        mesh = vescale.init_mesh(shape, names)
        model = _build(model_name, kernel)
        plan = moe_plan(mesh, model.config, zero3=zero3, sequence_parallel="+SP" in name)
        vescale.parallelize(model, plan, mesh)
        experts = model.get_submodule(EXPERTS)
        local = {n: p._local_tensor.detach().clone() for n, p in experts.named_parameters()}
        rows = []  # tokens the experts module gets per call, as it sees them (global on its mesh, and local)
        experts.register_forward_pre_hook(lambda m, a: rows.append((a[0].shape[0], _local_rows(a[0]))))
        out = _train(model)
        results[(model_name, kernel, name)] = {
            "local": local,
            "rows": rows,
            "coord": dict(zip(names, mesh.get_coordinate())),
            **(out if dist.get_rank() == 0 else {}),
        }
    return results


def _local_rows(t: torch.Tensor) -> int:
    return (t._local_tensor if isinstance(t, DTensor) else t).shape[0]


def _expected_local(full: torch.Tensor, tensor: str, coord: dict, sizes: dict) -> torch.Tensor:
    """The piece of a single-device expert tensor a rank should hold under moe_plan (at rest).
    The ZeRO-3 (DP) shard is a piece of the rank's EP / TP shard (vescale.placement.nested: a tensor
    dim EP and DP both shard is split by EP first, then by DP within), so DP applies last."""
    t = full
    for dim_name in sorted(coord, key=lambda d: d == "DP"):
        n, r = sizes[dim_name], coord[dim_name]
        if dim_name == "TP" and tensor == "gate_up_proj":  # its slice of the gate half and of the up half
            gate, up = t.chunk(2, 1)
            t = torch.cat([gate.chunk(n, 1)[r], up.chunk(n, 1)[r]], 1)
        elif dim_name == "TP":  # down_proj, row-parallel: its intermediate columns
            t = t.chunk(n, 2)[r]
        else:  # EP: whole experts; DP (ZeRO-3 at rest): 1/DP of the experts
            t = t.chunk(n, 0)[r]
    return t


def _check(per_rank: list, configs) -> None:
    for model_name, kernel, name, shape, names, _ in configs:
        ref = _single_device(model_name, kernel)
        label = f"{model_name} ({kernel or 'default'} experts), {name}"
        got = per_rank[0][(model_name, kernel, name)]
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
            assert abs(a - b) <= TOL, f"{label}: step {step} loss {a} vs single-device {b}"
        for what in ("grads", "params"):
            diff, where = max(((got[what][k] - ref[what][k]).abs().max().item(), k) for k in ref[what])
            assert diff <= TOL, f"{label}: {what} of {where} differ by {diff:.3g}"
        assert ref["losses"][-1] < ref["losses"][0], "training must make progress for the check to mean something"
        sizes = dict(zip(names, shape))
        for rank_results in per_rank:
            r = rank_results[(model_name, kernel, name)]
            if "EP" not in sizes:
                # The experts run on this DP rank's tokens only (plan.batch_local): batch x sequence / DP
                # rows, on DTensors (tensor-parallel experts) as on the local tensors.
                want = BATCH * SEQ // sizes.get("DP", 1)
                assert set(r["rows"]) == {(want, want)}, f"{label}: experts saw (rows, local rows) {set(r['rows'])}, want {want}"
            for tensor, local in r["local"].items():
                want = _expected_local(ref["init"][f"{EXPERTS}.{tensor}"], tensor, r["coord"], sizes)
                assert local.shape == want.shape, f"{label}: {tensor} local shape {tuple(local.shape)}, want {tuple(want.shape)}"
                assert torch.equal(local, want), f"{label}: {tensor} on {r['coord']} holds the wrong piece"


@pytest.mark.multiproc
def test_two_rank_tp_and_ep_match_single_device_with_every_kernel():
    _check(run_on_ranks(_distributed, 2, CONFIGS_2, timeout=900), CONFIGS_2)


@pytest.mark.multiproc
def test_four_rank_dp_tp_sp_ep_zero3_match_single_device():
    _check(run_on_ranks(_distributed, 4, CONFIGS_4, timeout=900), CONFIGS_4)


# A new sequence length every step (eager): the shape-free cache replays decisions learned at
# another length (vescale.dispatch.fast.cache) inside a real MoE model, over real collectives.
LENGTHS = (8, 12, 8, 20)


def _train_over_lengths(model) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, new_length_hits = [], []
    cache = vescale.dispatch.shape_free_cache()
    for step, seq in enumerate(LENGTHS):
        (input_ids, labels), = synthetic_batches(1, BATCH, seq, 128, seed=10 + step)
        hits = cache.hits if cache is not None else 0
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_value(loss).item())
        new_length_hits.append(cache.hits - hits if cache is not None else 0)
    return {"losses": losses, "hits": new_length_hits,
            "params": {n: _value(p) for n, p in model.named_parameters()}}


def _eager_over_lengths(shape, names, zero3, sp):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = vescale.init_mesh(shape, names)
    model = _build("mixtral", None)
    vescale.parallelize(model, moe_plan(mesh, model.config, zero3=zero3, sequence_parallel=sp), mesh)
    local = {n: tuple(p._local_tensor.shape) for n, p in model.get_submodule(EXPERTS).named_parameters()}
    return {**_train_over_lengths(model), "local": local}


@pytest.mark.multiproc
@pytest.mark.parametrize("shape, names, zero3, sp", [((2,), ("TP",), False, True), ((2,), ("DP",), True, False)],
                         ids=["TP=2+SP", "DP=2+ZeRO-3"])
def test_eager_training_over_new_lengths_matches_single_device(shape, names, zero3, sp):
    want = _train_over_lengths(_build("mixtral", None))
    got = run_on_ranks(_eager_over_lengths, 2, shape, names, zero3, sp, timeout=600)[0]
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"])):
        assert abs(a - b) <= TOL, f"length {LENGTHS[step]}: loss {a} vs single-device {b}"
    diff, where = max(((got["params"][k] - want["params"][k]).abs().max().item(), k) for k in want["params"])
    assert diff <= TOL, f"parameter {where} differs by {diff:.3g} after training over lengths {LENGTHS}"
    # The new lengths (12, 20) were served by replayed decisions, and the experts really are split.
    assert got["hits"][1] >= 10 and got["hits"][3] >= 10, f"shape-free hits per step: {got['hits']}"
    full = dict(_build("mixtral", None).get_submodule(EXPERTS).named_parameters())
    assert all(got["local"][n][d] * 2 == full[n].shape[d] for n in got["local"] for d in
               ([1] if "TP" in names and n == "gate_up_proj" else [2] if "TP" in names else [0])), got["local"]
