"""Static Eager mode with activation checkpointing (``vescale/static/recompute.py``).

Each configuration trains 4 SGD steps (momentum 0.9) with attention and residual dropout on (drawn by
vescale's RNG), checkpointed three ways: ``torch.utils.checkpoint`` around each zoo LLaMA decoder
layer's body (the region starts inside the layer, whose residual dropouts it draws), HF's
``gradient_checkpointing_enable`` on ``LlamaForCausalLM`` (HF 5 checkpoints each layer's ``forward``
too), and selective checkpointing (a policy saving the matmuls) on the zoo LLaMA; always with
``context_fn=vescale.random.checkpoint_context`` (``policy=`` for the selective one). Compared with

* eager mode with the same checkpointing: every loss, the last step's gradients and the final
  parameters equal (``torch.equal``): a recomputation runs the forward's local ops on the forward's
  local values, so the gradients are those of eager mode's recomputation;
* the single device without checkpointing, under ``vescale.random.consistent()``: losses, last
  gradients and final parameters within 1e-5 (fp32: collectives and sharded matmuls add in another
  order, a few ulps per step; checkpointing itself changes no number, the recomputation redraws the
  forward's dropout masks).

That the static path ran: the runtime counts static steps and recomputations (one per layer and static
step), and a hook on ``model.layers.0.mlp.down_proj`` sees, in the last step's forward and in its
recomputation in backward, a plain tensor of the local shape (``intermediate / TP`` columns). The split
check (``tests/split_checks.py``) asserts every parameter's local shard. CI: about 60 s on 2 cores.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

import vescale
from vescale.plan.ir import PlanError
from vescale.random import consistent
from vescale.testing import assert_local_shapes, run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_hf_llama, tiny_llama

from split_checks import llama_divisors

STEPS, LR, TOL, SEED = 4, 0.05, 1e-5, 1234
CONFIGS = {
    "TP=2+SP": ((2,), ("TP",), True, False),
    "DP=2xTP=2+SP+ZeRO-3": ((2, 2), ("DP", "TP"), True, True),
}


def _save_matmuls(ctx, op, *args, **kwargs):
    saved = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_layers(model, context_fn=vescale.random.checkpoint_context, use_reentrant=False):
    """``torch.utils.checkpoint`` around each zoo LLaMA decoder layer's body."""
    for layer in model.model.layers:
        body = type(layer).forward

        @functools.wraps(body)
        def forward(*args, layer=layer, body=body, **kwargs):
            extra = {} if context_fn is None else {"context_fn": context_fn}
            return checkpoint(functools.partial(body, layer, **kwargs), *args, use_reentrant=use_reentrant, **extra)

        layer.forward = forward


def build(variant: str | None):
    torch.manual_seed(0)
    if variant == "hf":
        model = tiny_hf_llama(use_cache=False, attention_dropout=0.1)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": False, "context_fn": vescale.random.checkpoint_context})
        return model
    model = tiny_llama(attention_dropout=0.1, hidden_dropout=0.1)
    if variant == "torch":
        checkpoint_layers(model)
    elif variant == "selective":
        checkpoint_layers(model, functools.partial(vescale.random.checkpoint_context, policy=_save_matmuls))
    return model


def _value(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def train(model, probe: bool = False) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    out = {"losses": [], "seen": []}
    for step, (input_ids, labels) in enumerate(synthetic_batches(STEPS, 4, 16, 128, seed=1)):
        handle = None
        if probe and step == STEPS - 1:  # what the body of a static module gets, forward and recomputed
            def look(mod, args):
                out["seen"].append((type(args[0]).__name__, tuple(args[0].shape), torch._C._current_graph_task_id() != -1))
            handle = model.model.layers[0].mlp.down_proj.register_forward_pre_hook(look)
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        if handle is not None:
            handle.remove()
        if step == STEPS - 1:
            out["grads"] = {n: _value(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        out["losses"].append(_value(loss).item())
    out["params"] = {n: _value(p) for n, p in model.named_parameters()}
    return out


@functools.cache
def _single_device(model: str) -> dict:
    model = build("hf" if model == "hf" else None)
    if hasattr(model, "gradient_checkpointing_disable"):
        model.gradient_checkpointing_disable()
    vescale.manual_seed(SEED)
    with consistent():
        return train(model)


def _distributed(config: str, variants: list[str]) -> dict:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    shape, names, sp, zero3 = CONFIGS[config]
    mesh = vescale.init_mesh(shape, names)
    tp, dp = mesh["TP"].size(), (mesh["DP"].size() if "DP" in names else 1)
    results = {}
    for variant in variants:
        runs = {}
        for mode in ("eager", "static"):
            model = build(variant)
            vescale.parallelize(model, llama_plan(mesh, model.config, sequence_parallel=sp, zero3=zero3), mesh, mode=mode)
            assert_local_shapes(model, llama_divisors(model.config, tp=tp, dp=dp, sequence_parallel=sp, zero3=zero3), variant)
            vescale.manual_seed(SEED)
            runs[mode] = train(model, probe=mode == "static")
            if mode == "static":
                rt = vescale.static.static_runtime(model)
                runs[mode]["counts"] = (rt.recorded_steps, rt.static_steps, rt.recomputations)
                runs[mode]["kept_eager"] = sorted(vescale.static.eager_modules(model))
                runs[mode]["local_mlp"] = model.config.intermediate_size // tp
        results[variant] = runs
    return results if dist.get_rank() == 0 else None


def _check(config: str, results: dict) -> None:
    for variant, runs in results.items():
        eager, static, what = runs["eager"], runs["static"], f"{variant} checkpointing, {config}"
        ref = _single_device("hf" if variant == "hf" else "zoo")
        recorded, ran_static, recomputed = static["counts"]
        assert recorded == 1 and ran_static == STEPS - 1, f"{what}: steps {static['counts']}"
        assert recomputed == 2 * ran_static, f"{what}: {recomputed} recomputations in {ran_static} static steps of 2 layers"
        assert static["kept_eager"] == [], f"{what}: modules kept eager {static['kept_eager']}"
        # The forward and the recomputation both ran the static body: a plain local tensor.
        kinds = {(kind, shape[-1], in_backward) for kind, shape, in_backward in static["seen"]}
        assert kinds == {("Tensor", static["local_mlp"], False), ("Tensor", static["local_mlp"], True)}, f"{what}: {kinds}"
        for step, (a, b, c) in enumerate(zip(static["losses"], eager["losses"], ref["losses"])):
            assert a == b, f"{what}: step {step} static loss {a!r} vs eager {b!r}"
            assert abs(a - c) <= TOL, f"{what}: step {step} static loss {a} vs single device {c}"
        for key in ("grads", "params"):
            differ = [k for k in eager[key] if not torch.equal(static[key][k], eager[key][k])]
            assert not differ, f"{what}: last-step {key} differ from eager mode's: {differ}"
            diff, where = max(((static[key][k] - ref[key][k]).abs().max().item(), k) for k in ref[key])
            assert diff <= TOL, f"{what}: {key} of {where} differ from the single device by {diff:.3g}"


@pytest.mark.multiproc
def test_static_checkpointing_on_tp_sp_matches_eager_and_single_device():
    _check("TP=2+SP", run_on_ranks(_distributed, 2, "TP=2+SP", ["torch", "hf", "selective"])[0])


@pytest.mark.multiproc
def test_static_checkpointing_on_dp_tp_zero3_matches_eager_and_single_device():
    config = "DP=2xTP=2+SP+ZeRO-3"
    _check(config, run_on_ranks(_distributed, 4, config, ["torch", "hf"])[0])


def _refusal(how: str) -> str:
    mesh = vescale.init_mesh((2,), ("TP",))
    torch.manual_seed(0)
    model = tiny_llama()
    if how == "reentrant":
        checkpoint_layers(model, context_fn=None, use_reentrant=True)
    else:
        checkpoint_layers(model, context_fn=torch.utils.checkpoint.noop_context_fn)
    vescale.parallelize(model, llama_plan(mesh, model.config), mesh, mode="static")
    try:
        train(model)
    except PlanError as e:
        return str(e)
    return "trained"


@pytest.mark.multiproc
@pytest.mark.parametrize("how", ["reentrant", "no context"])
def test_static_refuses_checkpointing_it_cannot_follow_by_name(how):
    message = run_on_ranks(_refusal, 2, how)[0]
    assert "model.layers." in message and "context_fn=vescale.random.checkpoint_context" in message, message
    assert ("by reentrant activation checkpointing" in message) == (how == "reentrant"), message
