"""Mesh dims of one rank (the DP dim of a ``(1, TP)`` mesh) move nothing, and a step pays nothing for them.

On a dim of one rank every placement holds the same local tensor: a Partial over one rank is its own
sum, a Shard the whole dim. Two places used to pay for such a dim anyway:

* a static step handed each weight's gradient over as recorded, ``Partial`` on the DP dim of one
  rank, so vescale.comm packed every such gradient into an all-reduce bucket, all-reduced it over
  the one rank and unpacked it. ``vescale.static.boundary.settled_on_unit_dims`` hands it over laid
  out like its parameter there instead;
* the plan's hooks placed the root's inputs (``input_ids`` / ``labels`` split over DP) and resolved
  the loss (``Partial("avg")`` over DP) through DTensor's ``redistribute``.
  ``vescale.parallel.placing.relabel`` gives the same DTensor, and ``redistribute``'s gradient,
  without it.

Checked here: relabel against ``redistribute`` on the fake group (values, placements, gradients,
no collective), and on 2 gloo ranks with a ``(1, 2)`` DP x TP mesh (zoo LLaMA, SP, dropout) that
static training equals, bit for bit, the same run with both shortcuts off, equals eager mode within
1e-6 and one device within 1e-5 (fp32 sums in another order), leaves every gradient laid out like its parameter, and issues one all-reduce fewer per step.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import vescale
from vescale.debug import CollectiveCounter
from vescale.parallel import hooks, placing
from vescale.parallel.placing import moves_nothing, relabel
from vescale.static import runtime
from vescale.testing import fake_world, global_value, run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_llama
from vescale.model_state import state_of


@pytest.mark.parametrize(
    "src, dst",
    [((Partial("avg"), Replicate()), (Replicate(), Replicate())),  # a loss averaged over a DP of 1
     ((Replicate(), Replicate()), (Shard(0), Replicate())),  # a batch split over it
     ((Partial(), Shard(1)), (Replicate(), Shard(1)))],
)
def test_relabel_is_redistribute_without_collectives(src, dst):
    with fake_world(4):
        mesh = vescale.init_mesh((1, 4), ("DP", "TP"))
        assert moves_nothing(mesh, src, dst) and not moves_nothing(mesh, (Replicate(), Replicate()), (Replicate(), Shard(0)))
        local = torch.randn(4, 6)
        results = {}
        for how in ("relabel", "redistribute"):
            x = local.clone().requires_grad_()
            d = DTensor.from_local(x, mesh, src, run_check=False)
            with CollectiveCounter() as counter:
                y = relabel(d, dst) if how == "relabel" else d.redistribute(mesh, dst)
                (y.to_local() * torch.arange(24.0).view(4, 6)).sum().backward()
            results[how] = (tuple(y.placements), y.shape, y.to_local().detach(), x.grad, counter.total)
        (pl, shape, value, grad, n), (pl_r, shape_r, value_r, grad_r, _) = results["relabel"], results["redistribute"]
        assert pl == pl_r == dst and shape == shape_r
        assert torch.equal(value, value_r) and torch.equal(grad, grad_r)
        assert n == 0, f"relabel issued {n} collectives"


def _train(mode: str, shortcuts: bool = True) -> dict:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    if not shortcuts:  # the paths before: hand-over as recorded, DTensor's redistribute at the root
        runtime.settled_on_unit_dims = lambda placements, spec: placements
        placing.moves_nothing = hooks.moves_nothing = lambda mesh, src, dst: False
    torch.manual_seed(0)
    model = tiny_llama(attention_dropout=0.1, hidden_dropout=0.1)
    if mode != "single":  # "single": one device, dropout under consistent()
        mesh = vescale.init_mesh((1, 2), ("DP", "TP"))
        vescale.parallelize(model, llama_plan(mesh, model.config, sequence_parallel=True), mesh, mode=mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    vescale.manual_seed(3)
    out = {"losses": [], "grads": [], "layouts": None}
    batches = list(synthetic_batches(5, 4, 16, 128, seed=4))
    for step, (x, y) in enumerate(batches):
        last = step == len(batches) - 1
        rng = vescale.random.consistent() if mode == "single" else contextlib.nullcontext()
        with CollectiveCounter() as counter, rng:
            loss = model(input_ids=x, labels=y).loss
            loss.backward()
        out["losses"].append(global_value(loss).item())
        out["grads"].append({n: global_value(p.grad) for n, p in model.named_parameters()})
        if last and mode != "single":
            out["collectives"] = dict(counter.counts)
            out["layouts"] = {n: (tuple(p.grad.placements), tuple(p.placements)) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    if mode == "static":
        rt = state_of(model).static
        out["steps"] = (rt.recorded_steps, rt.static_steps)
        out["eager_modules"] = sorted(rt.latest().unsafe)
    return out


def _runs():  # "before" last: its patches stay in this rank process
    return {"eager": _train("eager"), "static": _train("static"), "before": _train("static", shortcuts=False)}


@pytest.mark.multiproc
def test_static_on_a_dp_of_one_rank():
    runs = run_on_ranks(_runs, 2)[0]
    eager, static, before = runs["eager"], runs["static"], runs["before"]
    single = _train("single")
    assert static["steps"][1] >= 3 and static["eager_modules"] == [], (static["steps"], static["eager_modules"])
    assert static["losses"] == before["losses"], (static["losses"], before["losses"])
    assert all(abs(a - b) <= 1e-5 for a, b in zip(static["losses"], single["losses"])), (static["losses"], single["losses"])
    for step, (a, b, c, d) in enumerate(zip(static["grads"], before["grads"], eager["grads"], single["grads"])):
        for name in a:
            assert torch.equal(a[name], b[name]), f"step {step}: {name} differs from the run without shortcuts"
            diff = (a[name] - c[name]).abs().max().item()
            assert diff <= 1e-6, f"step {step}: {name} gradient differs from eager by {diff:.3g}"
            diff = (a[name] - d[name]).abs().max().item()  # fp32 sums in another order, as in test_static_llama.py
            assert diff <= 1e-5, f"step {step}: {name} gradient differs from one device by {diff:.3g}"
    for name, (grad, param) in static["layouts"].items():
        assert grad == param, f"{name}: gradient laid out as {grad}, its parameter as {param}"
    # The weights' gradients (Partial on DP only) no longer go through an all-reduce bucket over
    # the one DP rank; the norms' (Partial on TP under SP) still are all-reduced.
    want = dict(before["collectives"])
    want["all_reduce"] -= 1
    assert static["collectives"] == want, (static["collectives"], before["collectives"])
    assert static["collectives"]["all_reduce"] >= 1, static["collectives"]
