"""The root's boundary in static steps: the user's plain inputs and the outputs the user gets.

In eager mode a plain root input becomes a Replicate DTensor that the plan's hook redistributes
(the batch split over DP), and the root's hook redistributes a Partial loss to Replicate, all through
DTensor's planner. Static steps run both as precompiled moves between the recorded layouts
(``vescale.static.program._root_moves``). On gloo ranks (zoo LLaMA with dropout, DP=2 x TP=2 + SP + ZeRO-3)
these tests check that

* static steps with the root's moves give the losses and gradients of the general path (the root's
  moves off) bit for bit, issue the same collectives, redistribute no DTensor anywhere (the
  general path does at the root every step), and hand the decoder this rank's part of the batch;
* the input contract still sees the global inputs: ranks given different batches fail with
  ``DataContractError`` in a static step;
* a hook the user put on the root before ``parallelize`` keeps the general path, and sees the loss
  as eager mode hands it over (``Partial`` over DP, before the root's own hook resolves it).
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import vescale
from vescale.comm import moves
from vescale.debug import CollectiveCounter
from vescale.parallel.contract import DataContractError
from vescale.testing import run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_llama
from vescale.model_state import state_of

STEPS = 5


@contextlib.contextmanager
def _counting_redistributes(counts: list):
    """Counts DTensor redistributions: DTensor's own and the plan hooks' (vescale.comm.moves)."""
    real, ours = DTensor.redistribute, moves.redistribute

    def counted(self, *args, **kwargs):
        counts[0] += 1
        return real(self, *args, **kwargs)

    def counted_ours(d, placements):
        counts[0] += 1
        return ours(d, placements)

    DTensor.redistribute, moves.redistribute = counted, counted_ours
    try:
        yield
    finally:
        DTensor.redistribute, moves.redistribute = real, ours


def _train(root_moves: bool, user_root_hook: bool = False) -> dict:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
    torch.manual_seed(0)
    model = tiny_llama(attention_dropout=0.1, hidden_dropout=0.1)
    seen_loss = []
    if user_root_hook:
        model.register_forward_hook(lambda m, args, out: seen_loss.append(tuple(out.loss.placements)))
    vescale.parallelize(model, llama_plan(mesh, model.config, sequence_parallel=True, zero3=True), mesh, mode="static")
    rt = state_of(model).static
    if not root_moves:
        rt.root_hooks = None  # the general path: DTensors placed by the plan's hook
    batch_rows = []
    model.model.register_forward_pre_hook(lambda m, args, kw: batch_rows.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vescale.manual_seed(3)
    out = {"losses": [], "grads": [], "redistributes": [], "collectives": []}
    for x, y in synthetic_batches(STEPS, 4, 16, 128, seed=1):
        counts, counter = [0], CollectiveCounter()
        with _counting_redistributes(counts), counter:
            loss = model(input_ids=x, labels=y).loss
            loss.backward()
        out["losses"].append(loss.full_tensor().item())
        out["grads"].append({n: p.grad.full_tensor().clone() for n, p in model.named_parameters()})
        out["redistributes"].append(counts[0])
        out["collectives"].append(dict(counter.counts))
        opt.step()
        opt.zero_grad()
    out["used"] = rt.latest().program[""].root_in is not None and rt._root_hooks_ours(model)
    out["steps"] = (rt.recorded_steps, rt.static_steps)
    out["batch_rows"] = batch_rows[-1]
    out["seen_loss"] = seen_loss[-1] if seen_loss else None
    return out


def _both():
    return _train(True), _train(False)


@pytest.mark.multiproc
def test_root_moves_match_the_general_path_bit_for_bit():
    fast, general = run_on_ranks(_both, 4)[0]
    assert fast["used"] and not general["used"]
    recorded, ran_static = fast["steps"]
    assert ran_static >= STEPS - 2, fast["steps"]
    assert fast["losses"] == general["losses"]
    for step, (a, b) in enumerate(zip(fast["grads"], general["grads"])):
        for name in a:
            assert torch.equal(a[name], b[name]), f"step {step}: {name}"
    assert fast["collectives"][-1] == general["collectives"][-1]
    # Static steps: no DTensor redistribution anywhere with the root's moves; the general path
    # redistributes the two root inputs and the loss at the root every step.
    assert fast["redistributes"][-ran_static:] == [0] * ran_static, fast["redistributes"]
    assert all(n >= 3 for n in general["redistributes"][-ran_static:]), general["redistributes"]
    assert fast["batch_rows"] == general["batch_rows"] == (2, 16)  # batch 4 over DP=2


def _contract_in_static_step():
    mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
    torch.manual_seed(0)
    model = tiny_llama()
    vescale.parallelize(model, llama_plan(mesh, model.config, sequence_parallel=True), mesh, mode="static",
                        check_inputs="always")
    vescale.manual_seed(3)
    batches = list(synthetic_batches(4, 4, 16, 128, seed=1))
    for x, y in batches[:3]:  # recorded, then static
        model(input_ids=x, labels=y).loss.backward()
    assert state_of(model).static.static_steps >= 1
    x, y = batches[3]
    if dist.get_rank() == 1:
        x = x.roll(1, 0)  # this rank was given another batch
    try:
        model(input_ids=x, labels=y)
    except DataContractError as e:
        return str(e)
    return None


@pytest.mark.multiproc
def test_input_contract_sees_the_global_inputs_in_static_steps():
    errors = run_on_ranks(_contract_in_static_step, 4)
    assert all(e is not None and "input_ids" in e for e in errors), errors


@pytest.mark.multiproc
def test_a_user_hook_on_the_root_keeps_the_general_path():
    def run():
        return _train(True, user_root_hook=True)

    out = run_on_ranks(run, 4)[0]
    assert not out["used"]
    assert all(n >= 3 for n in out["redistributes"][-2:]), out["redistributes"]
    assert out["seen_loss"][0].is_partial(), out["seen_loss"]
