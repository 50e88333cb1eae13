"""The random replay's dispatch mode is on around the calls that draw, not over whole drawing bodies.

``vescale/static/random_gate.py``: the first static step of a record learns which torch functions a
drawing body's random ops come from (``F.dropout`` in the zoo LLaMA); later static steps switch the
replay's dispatch mode on around those calls only. Checked here:

* on 2 gloo ranks (zoo LLaMA, TP=2 + SP, attention and residual dropout): training equals, bit for
  bit (losses, every step's gradients), the same run with the replay over whole drawing bodies
  (as when nothing can be gated); the learnt functions are ``F.dropout`` alone; in a gated step the
  replay's dispatch mode sees the dropout calls' own ops and nothing else; afterwards each rank
  checks its split (``split_checks.check_llama_split``);
* a module that draws through a function it did not call in the learning step fails at the end of
  that forward, naming the module and ``plan.eager``, rather than drawing unreplayed numbers.
"""

from __future__ import annotations

import collections
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vescale
from vescale import PlanError, Replicate, Shard, VescalePlan
from vescale.static import random_gate, runtime
from vescale.testing import error_of, fake_world, run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_llama

from split_checks import check_llama_split, probe_batch
from vescale.model_state import state_of


def _train(gated: bool) -> dict:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    if not gated:  # every draw looks untracked: the record keeps the replay over whole bodies
        random_gate.CallTracker.note_draw = lambda self: setattr(self, "untracked", True)
    seen = collections.Counter()  # aten ops the replay's dispatch mode saw, in the last step
    replay_dispatch = runtime._RandomReplay.__torch_dispatch__

    def counting(self, func, types, args=(), kwargs=None):
        seen[str(func)] += 1
        return replay_dispatch(self, func, types, args, kwargs)

    mesh = vescale.init_mesh((2,), ("TP",))
    torch.manual_seed(0)
    model = tiny_llama(attention_dropout=0.1, hidden_dropout=0.1)
    vescale.parallelize(model, llama_plan(mesh, model.config, sequence_parallel=True), mesh, mode="static")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    vescale.manual_seed(5)
    out = {"losses": [], "grads": []}
    batches = list(synthetic_batches(5, 4, 16, 128, seed=6))
    for step, (x, y) in enumerate(batches):
        if step == len(batches) - 1:
            runtime._RandomReplay.__torch_dispatch__ = counting
        loss = model(input_ids=x, labels=y).loss
        loss.backward()
        runtime._RandomReplay.__torch_dispatch__ = replay_dispatch
        out["losses"].append(loss.full_tensor().item())
        out["grads"].append({n: p.grad.full_tensor().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    rt = state_of(model).static
    rec = rt.latest()
    out["steps"] = (rt.recorded_steps, rt.static_steps)
    out["funcs"] = sorted(f.__qualname__ for f in rec.random_funcs or ())
    out["draws"] = sum(len(v) for v in rec.random.values())
    out["seen"] = dict(seen)
    check_llama_split(model, probe_batch(), tp=2, sequence_parallel=True, label=f"static TP=2+SP, gated={gated}")
    return out


def _runs():
    return {"gated": _train(True), "whole": _train(False)}  # "whole" last: its patch stays in this process


@pytest.mark.multiproc
def test_gated_replay_trains_bit_for_bit_like_the_replay_over_whole_bodies():
    runs = run_on_ranks(_runs, 2)[0]
    gated, whole = runs["gated"], runs["whole"]
    assert gated["steps"] == whole["steps"] and gated["steps"][1] >= 3, gated["steps"]
    assert gated["losses"] == whole["losses"], (gated["losses"], whole["losses"])
    for step, (a, b) in enumerate(zip(gated["grads"], whole["grads"])):
        for name in a:
            assert torch.equal(a[name], b[name]), f"step {step}: {name} differs from the replay over whole bodies"
    assert gated["funcs"] == ["dropout"], gated["funcs"]
    assert whole["funcs"] == [], whole["funcs"]
    # Gated: only the dropout calls' ops (each one draw plus its few mask ops) reach the dispatch mode.
    random_ops = sum(n for op, n in gated["seen"].items() if "bernoulli" in op)
    assert random_ops == gated["draws"], gated["seen"]
    assert sum(gated["seen"].values()) <= 5 * gated["draws"], gated["seen"]
    assert sum(whole["seen"].values()) > 5 * sum(gated["seen"].values()), (whole["seen"], gated["seen"])


class _Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)
        self.by_hand = False  # draw the mask with torch.bernoulli instead of F.dropout

    def forward(self, x):
        h = self.proj(x)
        if self.by_hand:
            return h * torch.bernoulli(torch.full_like(h, 0.9)) / 0.9
        return F.dropout(h, 0.1, self.training)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.noisy = _Noisy()

    def forward(self, x):
        return self.noisy(x).pow(2).mean()


def test_a_draw_through_an_unlearnt_function_fails_naming_the_module():
    with fake_world(2):
        mesh = vescale.init_mesh((2,), ("TP",))
        plan = VescalePlan()
        plan.shard(r"noisy\.proj\.weight", Shard(0), mesh="TP")
        plan.shard(r"noisy\.<in>", Replicate(), mesh="TP")
        torch.manual_seed(0)
        vescale.manual_seed(0)
        model = vescale.parallelize(_Model(), plan, mesh, mode="static")
        x = torch.randn(2, 3, 8)
        rt = state_of(model).static
        for _ in range(6):  # records (once or twice), learns (first static step), runs gated
            model(x).backward()
            if rt.static_steps == 2:
                break
        assert rt.static_steps == 2 and rt.latest().random_funcs == frozenset({F.dropout}), rt.latest().random_funcs
        model.noisy.by_hand = True
        message = error_of(lambda: model(x), kind=PlanError)
    assert message is not None, "an unreplayed draw went through silently"
    assert "module 'noisy'" in message and "plan.eager('noisy')" in message, message
