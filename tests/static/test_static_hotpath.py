"""The static step's hot path: per-module decisions, parameters as plain leaves, gradient hand-over.

A static step decides once per record what each module's hooks do (most do nothing and return at
once), gives static module bodies plain leaf tensors for their DTensor parameters
(``vescale.static.boundary.ParamShadow``) and hands each parameter's summed local gradient over as
a DTensor through the parameter's own hooks, as autograd's AccumulateGrad would. On 2 gloo ranks
(zoo LLaMA, TP=2 + SP, dropout on) these tests check that

* static steps give the gradients of the ``local_of`` path (an autograd node per parameter use) bit
  for bit, and eager mode's within 1e-6: a plain step, a step whose zero_grad runs
  between forward and backward, and a step that accumulates onto the previous gradients;
* a parameter's own hooks run once per backward, and a hook that replaces the gradient takes
  effect (it doubles one weight's gradient here);
* every static module body, including those whose hooks have nothing to do, sees plain tensors
  as its parameters (and the parameters are DTensors again after the step);
* a static step issues exactly eager mode's collectives.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.distributed.tensor import DTensor

import vescale
from vescale.debug import CollectiveCounter
from vescale.testing import run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_llama

SEED = 7
HOOKED = "model.layers.1.mlp.up_proj.weight"


def _grads(model) -> dict:
    return {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None}


def _train(mode: str, param_leaves: bool = True) -> dict:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = vescale.init_mesh((2,), ("TP",))
    torch.manual_seed(0)
    model = tiny_llama(attention_dropout=0.1, hidden_dropout=0.1)
    vescale.parallelize(model, llama_plan(mesh, model.config, sequence_parallel=True), mesh, mode=mode)
    if mode == "static":
        model._vescale_static.param_leaves = param_leaves
    params = dict(model.named_parameters())
    fired = {"post": 0}
    params[HOOKED].register_hook(lambda g: g * 2)
    params[HOOKED].register_post_accumulate_grad_hook(lambda p: fired.__setitem__("post", fired["post"] + 1))
    # Registered after parallelize: runs after the runtime's own pre-hooks, so it sees what the body sees.
    seen: dict[str, set] = {}
    for path, mod in model.named_modules():
        if mod._parameters:
            mod.register_forward_pre_hook(
                lambda m, args, path=path: seen.setdefault(path, set()).update(
                    type(p).__name__ for p in m._parameters.values() if p is not None
                )
            )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    vescale.manual_seed(SEED)
    out = {"grads": [], "posts": []}
    batches = list(synthetic_batches(6, 4, 16, 128, seed=2))
    for step, (x, y) in enumerate(batches):
        seen.clear()
        fired["post"] = 0
        counter = CollectiveCounter()
        with counter:
            loss = model(input_ids=x, labels=y).loss
            if step == 3:
                opt.zero_grad()  # between forward and backward: the gradients start from nothing
            loss.backward()
        out["posts"].append(fired["post"])
        out["grads"].append(_grads(model))
        if step == 4:
            continue  # step 5 accumulates onto step 4's gradients
        opt.step()
        opt.zero_grad()
    out["collectives"] = dict(counter.counts)
    out["param_types"] = {path: sorted(types) for path, types in seen.items()}
    out["after"] = sorted({type(p).__name__ for p in model.parameters()})
    if mode == "static":
        rt = model._vescale_static
        out["steps"] = (rt.recorded_steps, rt.static_steps)
        out["eager_modules"] = sorted(set(rt.latest().unsafe) | rt.forced_eager)
    return out


def _runs():
    return {"eager": _train("eager"), "static": _train("static"), "local_of": _train("static", param_leaves=False)}


@pytest.mark.multiproc
def test_static_hot_path_matches_eager_bit_for_bit():
    runs = run_on_ranks(_runs, 2)[0]
    eager, static, local_of = runs["eager"], runs["static"], runs["local_of"]
    recorded, ran_static = static["steps"]
    assert ran_static >= 3, static["steps"]
    for step, (a, b, c) in enumerate(zip(static["grads"], local_of["grads"], eager["grads"])):
        assert a.keys() == b.keys() == c.keys(), step
        for name in a:
            assert torch.equal(a[name], b[name]), (
                f"step {step}: {name} gradient differs from the local_of path by {(a[name] - b[name]).abs().max().item():.3g}"
            )
            # Eager mode sums some gradients in another order (the recording steps too): a few ulps.
            diff = (a[name] - c[name]).abs().max().item()
            assert diff <= 1e-6, f"step {step}: {name} gradient differs from eager by {diff:.3g}"
    assert static["posts"] == local_of["posts"] == eager["posts"] == [1] * 6, (static["posts"], eager["posts"])
    assert static["collectives"] == eager["collectives"], (static["collectives"], eager["collectives"])
    # The last step ran static: every module body outside the eager ones saw plain tensors.
    eager_modules = set(static["eager_modules"])
    for path, types in static["param_types"].items():
        want = ["DTensor"] if path in eager_modules else ["Tensor"]
        assert types == want, f"{path}: its body saw parameters of type {types}, want {want}"
    assert static["after"] == ["DTensor"], static["after"]
