"""Static Eager mode refuses what it cannot replay, and says which module and what to write.

A module that computes a size that sharding changes (here a global head count in ``unflatten``)
computes something else on local shards without any error of its own: per-head softmax over 1
element instead of 2. The first static step checks every size-taking op against the shapes the
eager step recorded and raises, naming the module and the ``plan.eager`` line that fixes it; with
that line the model trains exactly as in eager mode. The same head count passed to ``view`` /
``reshape`` is rewritten to the local one instead (``vescale/static/local_sizes.py``): that module
runs static and trains exactly as in eager mode.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import vescale
from vescale import PlanError, Replicate, Shard, VescalePlan
from vescale.testing import error_of, fake_world, run_on_ranks
from vescale.model_state import state_of


class GlobalHeads(nn.Module):
    HEADS = 4  # the global head count, as a config would give it

    def __init__(self, split: str = "unflatten"):
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)
        self.out = nn.Linear(8, 8, bias=False)
        self.split = split

    def forward(self, x):
        b, s, _ = x.shape
        h = self.proj(x)
        if self.split == "view":  # rewritten to the local head count in static steps
            h = h.view(b, s, self.HEADS, -1)
        else:  # wrong on local shards (unflatten's own view is not the model's call)
            h = h.unflatten(-1, (self.HEADS, -1))
        return self.out(h.softmax(-1).reshape(b, s, -1))


class Model(nn.Module):
    def __init__(self, split: str = "unflatten"):
        super().__init__()
        self.attn = GlobalHeads(split)

    def forward(self, x):
        return self.attn(x).pow(2).mean()


def _plan(eager: bool) -> VescalePlan:
    plan = VescalePlan()
    plan.shard(r"attn\.proj\.weight", Shard(0), mesh="TP")
    plan.shard(r"attn\.out\.weight", Shard(1), mesh="TP")
    plan.shard(r"attn\.<in>", Replicate(), mesh="TP")
    if eager:
        plan.eager(r"attn")
    return plan


def _train(mode: str, eager: bool, steps: int = 4, split: str = "unflatten"):
    mesh = vescale.init_mesh((2,), ("TP",))
    torch.manual_seed(0)
    model = vescale.parallelize(Model(split), _plan(eager), mesh, mode=mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(step))
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor().item())
    return losses, model


def _global_size_error():
    return error_of(_train, "static", False, kind=PlanError)


def _with_eager_line():
    eager, eager_model = _train("eager", eager=False)
    static, model = _train("static", eager=True)
    rt = state_of(model).static
    recorded = rt.recorded_steps
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():  # an evaluation forward runs eagerly and keeps the training records
        evals = (model(x).full_tensor().item(), eager_model(x).full_tensor().item())
    model(x).backward()  # the next training step is static again, not a new recording
    after = (rt.recorded_steps - recorded, rt.state)
    return eager, static, (rt.recorded_steps, rt.static_steps), vescale.static.export_plan(model), evals, after


@pytest.mark.multiproc
def test_a_global_size_fails_in_the_first_static_step_naming_module_and_fix():
    message = run_on_ranks(_global_size_error, 2)[0]
    assert message is not None, "static mode computed with a global head count on local shards"
    assert "module 'attn'" in message and "plan.eager('attn')" in message, message


def _view_with_global_heads():
    eager, _ = _train("eager", eager=False, steps=5, split="view")
    static, model = _train("static", eager=False, steps=5, split="view")
    rt = state_of(model).static
    rec = rt.latest()
    rewrites = [(r.positions, r.global_sizes, r.local_sizes) for r in rec.sizes.get("attn", []) if r is not None]
    return eager, static, (rt.recorded_steps, rt.static_steps), sorted(rec.unsafe), rewrites, vescale.static.export_plan(model)


@pytest.mark.multiproc
def test_a_global_head_count_in_view_runs_static_with_the_local_one():
    eager, static, steps, unsafe, rewrites, exported = run_on_ranks(_view_with_global_heads, 2)[0]
    # (The root stays eager: its mean of the TP-partial output needs DTensor.)
    assert steps[1] >= 3 and "attn" not in unsafe, f"steps {steps}, eager modules {unsafe}"
    # view(b, s, 4, -1) on the TP-split projection: the head count (position 2) is 2 on each rank.
    assert rewrites == [((2,), (4,), (2,))], rewrites
    # export_plan says so (a comment: the recording finds these, no statement is needed)
    assert "# module 'attn', sized call #0: static steps pass (*, *, 2, *) for the global (*, *, 4, *)" in exported, exported
    assert static == eager  # the same local ops and collectives: equal to the last bit


@pytest.mark.multiproc
def test_plan_eager_keeps_the_module_on_dtensors_and_trains_like_eager():
    eager, static, steps, exported, evals, after = run_on_ranks(_with_eager_line, 2)[0]
    assert static == eager  # the same ops and collectives: equal to the last bit
    assert steps[1] >= 2, f"no static step ran: {steps}"
    assert "plan.eager('attn')  # plan.eager" in exported
    assert evals[0] == evals[1], f"no-grad forward: static model {evals[0]}, eager model {evals[1]}"
    assert after == (0, vescale.static.State.STATIC), f"after an eval forward: {after}"


def test_bad_mode_and_bad_eager_path_are_refused(fake_world_2):
    mesh = vescale.init_mesh((2,), ("TP",))
    with pytest.raises(ValueError, match="mode must be 'eager' or 'static'"):
        vescale.parallelize(Model(), _plan(False), mesh, mode="fast")
    plan = _plan(False).eager(r"atn")
    with pytest.raises(PlanError, match=r"plan.eager\('atn'\): matches no module that runs forward; closest real paths: attn"):
        vescale.parallelize(Model(), plan, mesh, mode="static")
    with pytest.raises(ValueError, match="not parallelized with mode='static'"):
        vescale.static.export_plan(Model())
    model = vescale.parallelize(Model(), _plan(False), mesh, mode="static")
    with pytest.raises(ValueError, match="nothing recorded yet"):
        vescale.static.export_plan(model)


@pytest.fixture
def fake_world_2():
    with fake_world(2):
        yield


class _Mix(nn.Module):
    """Expands a batch-sharded tensor to the batch size read from a whole (plain) one: fine on
    DTensors (both sizes are global), impossible on local shards (the sizes differ). (A ``view`` or
    ``reshape`` that way would get the local size: ``vescale/static/local_sizes.py``; an ``expand``
    of a DTensor does not: its gradient's layout in static steps is not recorded.)"""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(6, 6)

    def forward(self, x, y):
        return self.w(y).sum(-1, keepdim=True).expand(x.shape[0], y.shape[1])


class _MixNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = _Mix()

    def forward(self, x, y):
        return self.mix(x, y).sum() * x.sum()


def _failing_reshape_error():
    mesh = vescale.init_mesh((2,), ("DP",))
    torch.manual_seed(0)
    model = _MixNet()
    plan = VescalePlan()
    plan.shard(r"mix\.<in>\[y\]", Shard(0), mesh="DP")
    vescale.parallelize(model, plan, mesh, mode="static")
    data = torch.Generator().manual_seed(0)

    def steps():
        for _ in range(4):
            x, y = torch.randn(4, 6, generator=data), torch.randn(4, 6, generator=data)
            model(x, y).backward()

    return error_of(steps, kind=PlanError)


@pytest.mark.multiproc
def test_an_op_that_fails_on_local_shards_names_module_and_fix():
    message = run_on_ranks(_failing_reshape_error, 2)[0]
    assert message is not None, "the static step should have refused the module"
    assert "module 'mix'" in message and "fails in Static Eager mode" in message, message
    assert "plan.eager('mix')" in message, message
