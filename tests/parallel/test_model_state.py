"""vescale keeps what it holds for a model in typed objects, not in the modules' ``__dict__``.

``state_of(model)`` (``vescale.model_state``) holds the plan IR, mesh, hooks, reducer, ZeRO-3
scheduler and Static Eager runtime; what one forward call carries between the hooks of a module is
its ``CallState`` (``vescale.parallel.hooks.call_state``); what ZeRO-3 keeps per parameter its
``ZeroParamState`` (``vescale.parallel.zero.zero_state``); the local optimiser step's per-optimiser
state its ``LocalStepState`` (``vescale.optim.local_step.step_state``). After ZeRO-3 training steps,
static (bucketed gathers) and eager per tensor (``bucket_mb=None``), no module, parameter or
optimiser has a ``_vescale`` entry of its own.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import vescale
from vescale.model_state import state_of
from vescale.parallel.zero import zero_state
from vescale.testing import run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_llama


def _train(mode: str, bucket_mb) -> dict:
    torch.manual_seed(0)
    model = tiny_llama()
    mesh = vescale.init_mesh((2,), ("DP",))
    vescale.manual_seed(0)
    vescale.parallelize(model, llama_plan(mesh, model.config, zero3=True), mesh, mode=mode, bucket_mb=bucket_mb)
    opt = torch.optim.AdamW(model.parameters())
    for input_ids, labels in synthetic_batches(3, 4, 8, 128, seed=1):
        model(input_ids=input_ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    state = state_of(model)
    return {
        "own entries": sorted({k for o in (*model.modules(), *model.parameters(), opt) for k in vars(o) if "_vescale" in k}),
        "gathered": sum(bool(zero_state(p).run_spec or zero_state(p).shared_gather) for p in model.parameters()),
        "static steps": state.static.static_steps if state.static is not None else None,
        "weights": len(list(model.parameters())),
        "has": {name: getattr(state, name) is not None for name in ("ir", "mesh", "reducer", "gathers", "step_check")},
    }


def test_parallelize_keeps_its_state_off_the_modules_parameters_and_optimizer():
    static, per_tensor = run_on_ranks(lambda: (_train("static", 25), _train("eager", None)), 2)[0]
    for got in (static, per_tensor):
        assert got["own entries"] == [], got["own entries"]
        assert got["gathered"] == got["weights"], got  # every parameter went through the ZeRO-3 state
    assert static["static steps"] >= 1, static  # the static path ran (and with it the call states)
    assert all(static["has"].values()), static["has"]
    assert not per_tensor["has"]["reducer"], per_tensor["has"]  # per tensor: no bucketed reducer


def test_a_plain_model_has_an_empty_state():
    model = nn.Linear(2, 2)
    assert state_of(model).ir is None and state_of(model).static is None
    assert state_of(model) is state_of(model)


def test_a_plain_optimizer_step_leaves_no_local_step_state():
    """The local step's global hooks run for every optimiser; one they never swapped gets no state."""
    from vescale import dispatch
    from vescale.optim.local_step import step_state

    dispatch.install()  # registers the global optimiser step hooks
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert step_state.peek(opt) is None
    assert opt.param_groups[0]["params"][0] is model.weight  # its parameters as given
