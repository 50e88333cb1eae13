"""export_plan's statements fed back into the plan, and plan.redistribute's gradient placements in
Static Eager mode (2 gloo ranks, TP=2).

* Round trip: the zoo LLaMA (SP, dropout on) trained in static mode with ``llama_plan`` and with
  ``llama_plan`` plus the statements ``export_plan`` printed for it: the same losses to the last bit
  (the statements say what the plan does, so nothing changes), and the second run exports the same
  text (a fixed point).
* An edited statement that disagrees with the model is an error naming the tensor.
* ``grad_dst`` in static mode: the precompiled move hands the gradient back as stated, like eager.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import vescale
from vescale.debug import CollectiveCounter
from vescale.placement import InterleavedShard
from vescale.plan.ir import PlanError
from vescale.testing import error_of, run_on_ranks, train_losses
from vescale.zoo import llama_plan, synthetic_batches, tiny_llama

STEPS = 4


def _plan_with(mesh, config, exported: str | None):
    plan = llama_plan(mesh, config)
    if exported is not None:
        scope = {"plan": plan, "Shard": Shard, "Replicate": Replicate, "Partial": Partial, "InterleavedShard": InterleavedShard}
        exec(exported, scope)  # what a user pasting the printed statements into their plan does
    return plan


def _train(exported: str | None):
    mesh = vescale.init_mesh((2,), ("TP",))
    torch.manual_seed(0)
    vescale.manual_seed(0)
    model = tiny_llama(hidden_dropout=0.1, attention_dropout=0.1)
    vescale.parallelize(model, _plan_with(mesh, model.config, exported), mesh, mode="static")
    losses = train_losses(model, synthetic_batches(STEPS, 4, 16, 128, seed=1), torch.optim.SGD(model.parameters(), lr=0.05))
    rt = vescale.static.static_runtime(model)
    return losses, vescale.static.export_plan(model), rt.static_steps


def _round_trip():
    losses, exported, static_steps = _train(None)
    again, exported_again, static_again = _train(exported)
    return losses, again, exported, exported_again, (static_steps, static_again)


@pytest.mark.multiproc
def test_exported_statements_fed_back_train_identically_and_export_the_same():
    losses, again, exported, exported_again, steps = run_on_ranks(_round_trip, 2)[0]
    assert min(steps) >= 2, f"static steps: {steps}"
    assert losses == again
    assert exported_again == exported
    assert len(re.findall(r"^plan\.redistribute\(", exported, re.M)) >= 4, exported
    assert "plan.annotate('model\\\\.norm\\\\.weight\\\\.grad', [Partial()])" in exported, exported


def _edited():
    _, exported, _ = _train(None)
    line = next(x for x in exported.splitlines() if x.startswith("plan.redistribute(") and "mlp" in x)
    wrong = line.replace("[Shard(1)], [Replicate()]", "[Shard(0)], [Replicate()]", 1)
    assert wrong != line, line
    return error_of(_train, exported.replace(line, wrong), kind=PlanError)


@pytest.mark.multiproc
def test_an_edited_statement_that_disagrees_with_the_model_is_an_error():
    message = run_on_ranks(_edited, 2)[0]
    assert message is not None and "mlp.<in>[x]" in message and "from [S(0)] but it arrives as [S(1)]" in message, message


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).sum()


def _grad_dst(mode: str, grad_dst):
    mesh = vescale.init_mesh((2,), ("TP",))
    torch.manual_seed(0)
    model = MLP()
    plan = vescale.VescalePlan()
    plan.shard(r"up\.(weight|bias)", Shard(0), mesh="TP").shard(r"down\.weight", Shard(1), mesh="TP")
    plan.shard(r"down\.<out>", Replicate(), mesh="TP")
    plan.redistribute(r"up\.<in>", Replicate(), Replicate(), grad_dst=grad_dst, mesh="TP")
    vescale.parallelize(model, plan, mesh, mode=mode)
    out = []
    for step in range(3):  # static mode: the first step records, the others run static
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        x = distribute_tensor(x, mesh, [Replicate()]).requires_grad_(True)
        with CollectiveCounter() as c:
            model(x).backward()
        out.append((x.grad.placements, x.grad.full_tensor(), c.total))
    # A recording's watcher lives until the next forward, beneath the user's modes: the counter
    # entered around each step saw every collective of it, and no mode is left open.
    assert not _get_current_dispatch_mode_stack(), _get_current_dispatch_mode_stack()
    return out


def _grad_dst_runs():
    return {(mode, name): _grad_dst(mode, g) for mode in ("eager", "static") for name, g in (("P", Partial()), ("R", Replicate()))}


@pytest.mark.multiproc
def test_static_moves_hand_the_gradient_back_as_grad_dst_says():
    runs = run_on_ranks(_grad_dst_runs, 2)[0]
    for g, want in (("P", (Partial(),)), ("R", (Replicate(),))):
        eager, static = runs[("eager", g)], runs[("static", g)]
        for (pe, ge, ce), (ps, gs, cs) in zip(eager, static):
            assert pe == ps == want, (g, pe, ps)
            assert torch.allclose(gs, ge, atol=1e-6)
            assert cs == ce, f"grad_dst={g}: static step issued {cs} collectives, eager {ce}"
    # Left Partial, the input gradient skips one all-reduce in backward.
    assert runs[("static", "P")][-1][2] == runs[("static", "R")][-1][2] - 1


def _counted_every_step():
    mesh = vescale.init_mesh((2,), ("TP",))
    torch.manual_seed(0)
    model = tiny_llama()
    vescale.parallelize(model, llama_plan(mesh, model.config), mesh, mode="static")
    counts = []
    for input_ids, labels in synthetic_batches(4, 4, 16, 128, seed=2):
        with CollectiveCounter() as c:  # around recording steps too
            model(input_ids=input_ids, labels=labels).loss.backward()
        counts.append(c.total)
    rt = vescale.static.static_runtime(model)
    return sorted(rt.latest().lookups), rt.static_steps, counts


@pytest.mark.multiproc
def test_a_collective_counter_around_recording_steps_hides_no_op_from_the_recording():
    # A mode that hands DTensor ops straight to DTensor would skip the recording's watcher beneath
    # it: the masked embedding was then taken for local (not recorded as a masked lookup) and
    # failed in the static step.
    lookups, static_steps, counts = run_on_ranks(_counted_every_step, 2)[0]
    assert lookups == ["model.embed_tokens"], lookups
    assert static_steps >= 2 and all(n > 0 for n in counts), (static_steps, counts)
