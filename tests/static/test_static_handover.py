"""Parameter gradients whose hooks are all idle are handed over at the end of backward, together.

``vescale.static.boundary.HandOvers``: a static step hands each parameter's summed local gradient
over through the parameter's own hooks (``ParamShadow``). Where every hook declares itself idle for
the gradient (vescale.comm's reduction hooks, when the gradient needs no collective: every weight
but the SP norms' under TP), the hand-over waits for a callback at the end of backward, which
hands all of them over at once. On 2 gloo ranks (zoo LLaMA, TP=2 + SP, dropout) this checks that

* training equals, bit for bit, the same run with every hand-over in autograd's order (also a step
  that accumulates onto the last one's gradients), with the same collectives;
* a parameter with a hook of its own is handed over in autograd's order (its hook runs during
  backward and sees the gradient), while an idle one's gradient appears only after backward's end:
  inside that hook ``lm_head.weight.grad`` (ready earlier in backward) is still unset when
  deferring, set when not; after ``backward()`` every gradient is there.
"""

from __future__ import annotations

import logging

import pytest
import torch

import vescale
from vescale.debug import CollectiveCounter
from vescale.static import boundary
from vescale.testing import run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_llama
from vescale.model_state import state_of

HOOKED = "model.layers.0.mlp.up_proj.weight"


def _train(deferred: bool) -> dict:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    if not deferred:  # no hook looks idle: every hand-over in autograd's order
        boundary._hooks_idle = lambda param, spec: False
    mesh = vescale.init_mesh((2,), ("TP",))
    torch.manual_seed(0)
    model = tiny_llama(attention_dropout=0.1, hidden_dropout=0.1)
    vescale.parallelize(model, llama_plan(mesh, model.config, sequence_parallel=True), mesh, mode="static")
    params = dict(model.named_parameters())
    seen = []  # per backward: was lm_head.weight.grad set when HOOKED's post-accumulate hook ran

    def hooked(p):
        seen.append(params["lm_head.weight"].grad is not None)

    params[HOOKED].register_post_accumulate_grad_hook(hooked)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    vescale.manual_seed(9)
    out = {"losses": [], "grads": [], "complete": []}
    batches = list(synthetic_batches(6, 4, 16, 128, seed=8))
    for step, (x, y) in enumerate(batches):
        with CollectiveCounter() as counter:
            loss = model(input_ids=x, labels=y).loss
            loss.backward()
        out["losses"].append(loss.full_tensor().item())
        out["grads"].append({n: p.grad.full_tensor().clone() for n, p in params.items()})
        out["complete"].append(all(p.grad is not None for p in params.values()))
        if step == 4:
            continue  # step 5 accumulates onto step 4's gradients
        opt.step()
        opt.zero_grad()
    out["collectives"] = dict(counter.counts)
    out["seen"] = seen
    rt = state_of(model).static
    out["steps"] = (rt.recorded_steps, rt.static_steps)
    return out


def _runs():
    return {"deferred": _train(True), "in_order": _train(False)}  # "in_order" last: its patch stays in this process


@pytest.mark.multiproc
def test_idle_hand_overs_wait_for_the_end_of_backward():
    runs = run_on_ranks(_runs, 2)[0]
    deferred, in_order = runs["deferred"], runs["in_order"]
    recorded, ran_static = deferred["steps"]
    assert ran_static >= 4 and deferred["steps"] == in_order["steps"], deferred["steps"]
    assert deferred["losses"] == in_order["losses"], (deferred["losses"], in_order["losses"])
    for step, (a, b) in enumerate(zip(deferred["grads"], in_order["grads"])):
        for name in a:
            assert torch.equal(a[name], b[name]), f"step {step}: {name} differs from the in-order hand-over"
    assert deferred["collectives"] == in_order["collectives"], (deferred["collectives"], in_order["collectives"])
    assert all(deferred["complete"]) and all(in_order["complete"])
    # Static steps with zeroed gradients (steps 0 and 5 start from other states: a recording step,
    # and a step accumulating onto the last one's gradients).
    static_steps = range(recorded, 5)
    assert [deferred["seen"][s] for s in static_steps] == [False] * len(static_steps), deferred["seen"]
    assert [in_order["seen"][s] for s in static_steps] == [True] * len(static_steps), in_order["seen"]
