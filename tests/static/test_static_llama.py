"""Static Eager mode computes what eager mode computes, bit for bit, and what the single device computes.

Each configuration trains 5 SGD steps (momentum 0.9) of the zoo LLaMA and of HF's unchanged LlamaForCausalLM with
``parallelize(..., mode="static")``, with attention and residual dropout on (p=0.1, drawn by vescale's
RNG), from the single-device weights, and compares with

* the eager-mode run of the same configuration: losses at every step, gradients of the last step (a
  static one; the first steps record eagerly) and final parameters equal (``torch.equal``): static
  steps run eager mode's local ops on eager mode's local values with its collectives, and the
  recording steps add no autograd node (``tests/static/test_static_equal.py`` covers every zoo model);
* the single-device run under ``vescale.random.consistent()``: losses at every step, last gradients
  and final parameters within 1e-5 (fp32; collectives and sharded matmuls sum in another order,
  which moves results by a few ulps).

SGD rather than AdamW: AdamW divides by sqrt(v), so elements whose gradient is near zero turn
ulp-level differences into 1e-5-level parameter differences (eager mode on HF's model with dropout
ends 6e-5 from the single device after 10 AdamW steps), which would hide what this test measures.

Equal numbers cannot show that the static path ran, so each run also reports how many steps ran
static, and how many DTensor ops one static step dispatched against an eager step (at most half:
the modules that are not eager must have run on local tensors), and which sizes static steps
rewrite (under DP, HF's mask code expands the position ids to the batch size it reads from the
embeddings).
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

import vescale
from vescale.debug import CollectiveCounter
from vescale.random import consistent
from vescale.testing import run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_hf_llama, tiny_llama
from vescale.model_state import state_of

STEPS, LR, TOL, SEED = 5, 0.05, 1e-5, 1234
MODELS = {
    "ours": lambda: tiny_llama(attention_dropout=0.1, hidden_dropout=0.1),
    "hf": lambda: tiny_hf_llama(use_cache=False, attention_dropout=0.1),
}
CONFIGS_2 = [
    ("TP=2+SP", (2,), ("TP",), True, False),
    # TP-only training's mesh, no SP: the size-1 DP dim splits no batch, so HF's model body runs static too.
    ("DP=1xTP=2", (1, 2), ("DP", "TP"), False, False),
]
CONFIGS_4 = [("DP=2xTP=2+SP+ZeRO-3", (2, 2), ("DP", "TP"), True, True), ("TP=4", (4,), ("TP",), False, False)]


class _DTensorOps(TorchDispatchMode):
    """Counts ops dispatched with DTensor arguments."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _value(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(model, count_step: int | None = None) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    out = {"losses": [], "grads": None, "dtensor_ops": None}
    for step, (input_ids, labels) in enumerate(synthetic_batches(STEPS, 4, 16, 128, seed=1)):
        counter, collectives = _DTensorOps(), CollectiveCounter()
        if step == count_step:
            collectives.__enter__()
            counter.__enter__()
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        if step == count_step:
            counter.__exit__(None, None, None)
            collectives.__exit__(None, None, None)
            out["dtensor_ops"], out["collectives"] = counter.count, collectives.total
        if step == STEPS - 1:
            out["grads"] = {n: _value(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        out["losses"].append(_value(loss).item())
    out["params"] = {n: _value(p) for n, p in model.named_parameters()}
    # Static steps must leave no dispatch mode behind: a leaked recording watcher would see (and
    # slow down) every later op of the process.
    out["modes_left"] = len(_get_current_dispatch_mode_stack())
    return out


def _build(name: str):
    torch.manual_seed(0)
    return MODELS[name]()


@functools.cache
def _single_device(name: str) -> dict:
    model = _build(name)
    vescale.manual_seed(SEED)
    with consistent():
        return _train(model)


def _distributed(configs):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    results = {}
    for name in MODELS:
        for label, shape, names, sp, zero in configs:
            mesh = vescale.init_mesh(shape, names)
            runs = {}
            for mode in ("eager", "static"):
                model = _build(name)
                vescale.parallelize(model, llama_plan(mesh, model.config, sequence_parallel=sp, zero3=zero), mesh, mode=mode)
                vescale.manual_seed(SEED)
                runs[mode] = _train(model, count_step=STEPS - 1)
                if mode == "static":
                    rt = state_of(model).static
                    runs[mode]["steps"] = (rt.recorded_steps, rt.static_steps)
                    runs[mode]["eager_modules"] = sorted(rt.latest().unsafe)
                    runs[mode]["kept_eager"] = sorted(vescale.static.eager_modules(model))
                    runs[mode]["rewrites"] = {p: [(r.positions, r.global_sizes) for r in rs if r is not None]
                                              for p, rs in rt.latest().sizes.items() if any(rs)}
            results[(name, label)] = runs if dist.get_rank() == 0 else None
    return results


def _check(results, configs):
    for name in MODELS:
        ref = _single_device(name)
        for label, *_ in configs:
            eager, static = results[(name, label)]["eager"], results[(name, label)]["static"]
            what = f"{name} model, {label}"
            recorded, ran_static = static["steps"]
            assert recorded + ran_static == STEPS and ran_static >= STEPS - 3, f"{what}: steps {static['steps']}"
            assert static["modes_left"] == 0, f"{what}: {static['modes_left']} dispatch modes left active after training"
            # At most half: under TP=4 the plan replicates K/V (TP does not divide the KV heads), so
            # DTensor slices them inside attention and attention rightly stays eager.
            assert static["dtensor_ops"] * 2 < eager["dtensor_ops"], (
                f"{what}: a static step dispatched {static['dtensor_ops']} DTensor ops, eager {eager['dtensor_ops']}"
            )
            # The same communication as eager mode, or less: no boundary may add a collective.
            # (Not asserted where attention stays eager — TP=4 with replicated K/V: there a static
            # step issues 2 more than eager, a known gap listed in docs/static.md.)
            if label != "TP=4":  # HF's body runs static too, under DP as well
                assert static["kept_eager"] == [], f"{what}: modules kept eager {static['kept_eager']}"
            # Under DP, HF's mask code expands the plain position ids to the batch size it reads
            # from the embeddings, this DP rank's share in static steps: that call gets the recorded
            # global batch (4) back. (llama_plan gathers the logits at the LM head, so HF's loss
            # views them with their own vocabulary size.) The zoo model reads sizes from its
            # tensors, so nothing of it is left to rewrite after the first static step.
            want = {}
            if name == "hf" and "DP=2" in label:
                want["model"] = [((0,), (4,))]
            assert static["rewrites"] == want, f"{what}: size rewrites {static['rewrites']}"
            attention_static = not any("self_attn" in m for m in static["eager_modules"])
            assert not attention_static or static["collectives"] <= eager["collectives"], (
                f"{what}: a static step issued {static['collectives']} collectives, eager {eager['collectives']}"
            )
            for step, (a, b, c) in enumerate(zip(static["losses"], ref["losses"], eager["losses"])):
                assert abs(a - b) <= TOL, f"{what}: step {step} static loss {a} vs single device {b}"
                assert a == c, f"{what}: step {step} static loss {a!r} vs eager {c!r}"
            for key in ("grads", "params"):
                diff, where = max(((static[key][k] - ref[key][k]).abs().max().item(), k) for k in ref[key])
                assert diff <= TOL, f"{what}: last-step {key} of {where} differ from single device by {diff:.3g}"
                differ = [k for k in eager[key] if not torch.equal(static[key][k], eager[key][k])]
                assert not differ, f"{what}: last-step {key} differ from eager mode's: {differ}"


@pytest.mark.multiproc
def test_static_two_ranks_matches_eager_and_single_device():
    _check(run_on_ranks(_distributed, 2, CONFIGS_2)[0], CONFIGS_2)


@pytest.mark.multiproc
def test_static_four_ranks_matches_eager_and_single_device():
    _check(run_on_ranks(_distributed, 4, CONFIGS_4)[0], CONFIGS_4)


def _train_lengths(model) -> list[float]:
    """SGD steps at sequence length 16, then 24."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for seq in (16, 16, 16, 24, 24):
        (x, y), = synthetic_batches(1, 4, seq, 128, seed=seq)
        loss = model(input_ids=x, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_value(loss).item())
    return losses


def _new_length_records_once():
    """Train at one sequence length, then at another, with record reuse off: the new length records in one eager step
    (it starts from the eager modules found before) and the next step runs static, computing what
    eager mode computes (equal losses: same local ops, collectives in the same order) and what one
    device computes (within TOL, as above)."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = vescale.init_mesh((2,), ("TP",))
    losses, models = {}, {}
    for mode in ("eager", "static"):
        model = models[mode] = _build("ours")
        vescale.parallelize(model, llama_plan(mesh, model.config, sequence_parallel=True), mesh, mode=mode)
        if mode == "static":
            state_of(model).static.reuse_records = False  # records the new length (test_static_resize derives it)
        vescale.manual_seed(SEED)
        losses[mode] = _train_lengths(model)
    rt = state_of(models["static"]).static
    return losses, (rt.recorded_steps, rt.static_steps)


@pytest.mark.multiproc
def test_a_new_sequence_length_records_in_one_step():
    losses, steps = run_on_ranks(_new_length_records_once, 2)[0]
    model = _build("ours")
    vescale.manual_seed(SEED)
    with consistent():
        single = _train_lengths(model)
    assert steps == (2, 3), f"(recorded, static) steps: {steps}; want 1 + 1 recorded, 2 + 1 static"
    assert losses["static"] == losses["eager"], (losses["static"], losses["eager"])
    for a, c in zip(losses["static"], single):
        assert abs(a - c) <= TOL, (losses["static"], single)


def _train_hf_sdpa(mode: str | None) -> tuple[list[float], torch.nn.Module]:
    torch.manual_seed(0)
    model = tiny_hf_llama(use_cache=False)
    if mode is not None:
        mesh = vescale.init_mesh((2,), ("TP",))
        vescale.parallelize(model, llama_plan(mesh, model.config, sequence_parallel=True), mesh, mode=mode)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for input_ids, labels in synthetic_batches(4, 4, 16, 128, seed=3):
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_value(loss).item())
    return losses, model


def _hf_sdpa_attention_stays_static():
    """HF LLaMA with its default attention (SDPA, no dropout: PyTorch's CPU flash kernel, run on
    DTensors by vescale's handler): heads-sharded q/k/v are already in the kernel's layout, so the
    attention modules run static, and compute what eager mode computes (equal losses) and what one
    device computes (within TOL, as above)."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    losses = {}
    for mode in ("eager", "static"):
        losses[mode], model = _train_hf_sdpa(mode)
    rt = state_of(model).static
    return losses, sorted(rt.latest().unsafe), (rt.recorded_steps, rt.static_steps), model.config._attn_implementation


@pytest.mark.multiproc
def test_hf_sdpa_attention_runs_static():
    losses, unsafe, steps, attn = run_on_ranks(_hf_sdpa_attention_stays_static, 2)[0]
    single, _ = _train_hf_sdpa(None)
    assert attn == "sdpa", attn
    assert steps[1] >= 2, steps
    assert not any("self_attn" in m for m in unsafe), f"attention kept eager: {unsafe}"
    assert losses["static"] == losses["eager"], losses
    for a, c in zip(losses["static"], single):
        assert abs(a - c) <= TOL, (losses["static"], single)
