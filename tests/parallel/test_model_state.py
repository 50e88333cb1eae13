"""vescale keeps what it holds for a model in typed objects, not in the modules' ``__dict__``.

``state_of(model)`` (``vescale.model_state``) holds the plan IR, mesh, hooks, reducer, ZeRO-3
scheduler and Static Eager runtime; what one forward call carries between the hooks of a module is
its ``CallState`` (``vescale.parallel.hooks.call_state``). After static training steps with ZeRO-3,
no module of the model has a ``_vescale`` entry of its own.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import vescale
from vescale.model_state import state_of
from vescale.testing import run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_llama


def _train_static() -> dict:
    torch.manual_seed(0)
    model = tiny_llama()
    mesh = vescale.init_mesh((2,), ("DP",))
    vescale.manual_seed(0)
    vescale.parallelize(model, llama_plan(mesh, model.config, zero3=True), mesh, mode="static")
    opt = torch.optim.AdamW(model.parameters())
    for input_ids, labels in synthetic_batches(3, 4, 8, 128, seed=1):
        model(input_ids=input_ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    state = state_of(model)
    return {
        "own entries": sorted({k for m in model.modules() for k in vars(m) if "_vescale" in k}),
        "static steps": state.static.static_steps,
        "has": {name: getattr(state, name) is not None for name in ("ir", "mesh", "reducer", "gathers", "step_check")},
    }


def test_parallelize_keeps_its_state_off_the_modules():
    for got in run_on_ranks(_train_static, 2):
        assert got["own entries"] == [], got["own entries"]
        assert got["static steps"] >= 1, got  # the static path ran (and with it the call states)
        assert all(got["has"].values()), got["has"]


def test_a_plain_model_has_an_empty_state():
    model = nn.Linear(2, 2)
    assert state_of(model).ir is None and state_of(model).static is None
    assert state_of(model) is state_of(model)
