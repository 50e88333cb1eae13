"""parallelize() on real ranks: what it refuses, the errors its hooks raise at run time, uneven shards,
and plan.factory.

Two spawns in all: one on 2 ranks gathers every check into a dict that the tests read, one on 4 ranks
trains an unevenly sharded Linear.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401  (DTensor imports it lazily; import once here, not in every forked rank)
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import vescale
from vescale import PlanError, VescalePlan
from vescale.testing import run_on_ranks


def _error(fn) -> tuple[str, str] | None:
    """(exception type, message) of what ``fn()`` raises, or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001  (the tests below check the type)
        return type(e).__name__, str(e)
    return None


def _fresh(cls, *args, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return cls(*args)


def _tp_plan(*statements) -> VescalePlan:
    plan = VescalePlan()
    for path, placement in statements:
        plan.shard(path, placement, mesh="TP")
    return plan


class Shift(nn.Module):
    def forward(self, x, shift):
        return x + shift


class LinearThenShift(nn.Module):
    """Calls a submodule with a Python number where the plan expects a tensor."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.shift = Shift()

    def forward(self, x):
        return self.shift(self.fc(x), 1.0)


class Positions(nn.Module):
    """Makes a tensor with a factory function inside forward and records what it got."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.seen: list[torch.Tensor] = []

    def forward(self, x):
        positions = torch.arange(x.shape[-1], dtype=x.dtype)
        self.seen.append(positions)
        return self.fc(x) + positions


class TwoPositions(nn.Module):
    """``planned`` gets plan.factory; ``plain`` makes its arange as a plain tensor next to DTensors."""

    def __init__(self):
        super().__init__()
        self.planned = Positions()
        self.plain = Positions()

    def forward(self, x):
        return self.plain(self.planned(x))


def _placements(t: torch.Tensor):
    return tuple(t.placements) if isinstance(t, DTensor) else "plain"


def _two_rank_checks() -> dict:
    mesh = vescale.init_mesh((dist.get_world_size(),), ("TP",))
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 10
    out = {}

    # Initial weights that differ across ranks (rank 1 used another seed).
    model = _fresh(LinearThenShift, seed=dist.get_rank())
    out["weights"] = _error(lambda: vescale.parallelize(model, _tp_plan((r"fc\.weight", Shard(0))), mesh))
    out["unchanged_after_weights"] = all(type(p) is nn.Parameter for p in model.parameters())

    # A lowering error changes nothing either.
    model = _fresh(LinearThenShift)
    out["lowering"] = _error(lambda: vescale.parallelize(model, _tp_plan((r"fc\.wieght", Shard(0))), mesh))
    out["unchanged_after_lowering"] = all(type(p) is nn.Parameter for p in model.parameters())

    # Twice on one model.
    vescale.parallelize(model, VescalePlan(), mesh)
    out["twice"] = _error(lambda: vescale.parallelize(model, VescalePlan(), mesh))

    # A planned <in> that is not a tensor.
    model = vescale.parallelize(_fresh(LinearThenShift), _tp_plan((r"shift\.<in>[shift]", Replicate())), mesh)
    out["not_a_tensor"] = _error(lambda: model(x))
    # The failed forward left the model usable: its parameters are its own DTensors.
    out["usable_after_error"] = all(isinstance(p, DTensor) for p in model.parameters())

    # A Shard dim that the activation does not have.
    model = vescale.parallelize(_fresh(LinearThenShift), _tp_plan((r"fc\.<out>", Shard(2))), mesh)
    out["shard_dim"] = _error(lambda: model(x))

    # plan.factory: the planned module's arange is a Shard(0) DTensor; the other module's is plain and
    # meets DTensors as Replicate. Both must compute what one device computes.
    reference = _fresh(TwoPositions)
    expected = reference(x)
    expected.sum().backward()
    model = _fresh(TwoPositions)
    plan = VescalePlan().factory("planned", Shard(0), mesh="TP")
    vescale.parallelize(model, plan, mesh)
    y = model(x)
    y.sum().backward()
    out["factory_seen"] = {
        "planned": [_placements(t) for t in model.planned.seen],
        "plain": [_placements(t) for t in model.plain.seen],
    }
    out["factory_output_error"] = (y.full_tensor() - expected).abs().max().item()
    out["factory_grad_error"] = max(
        (p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters())
    )

    # A loss computed outside the model from a batch-sharded output (4 different rows, 2 per rank).
    batch = torch.arange(16, dtype=torch.float32).reshape(4, 4) / 10
    expected = (_fresh(nn.Linear, 4, 1)(batch) ** 2).mean()
    model = vescale.parallelize(_fresh(nn.Linear, 4, 1), _tp_plan(("<in>", Shard(0))), mesh)
    loss = (model(batch) ** 2).mean()
    out["outside_loss"] = (expected.item(), loss.full_tensor().item(), loss.item())
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_on_ranks(_two_rank_checks, 2)


def test_ranks_agree(two_ranks):
    agreed = [{k: v for k, v in r.items() if k != "outside_loss"} for r in two_ranks]
    assert agreed[0] == agreed[1]  # every rank raises (no rank is left waiting in a collective)


def test_differing_initial_weights_are_refused(two_ranks):
    kind, message = two_ranks[0]["weights"]
    assert kind == "RuntimeError"
    assert "model weights differ across ranks" in message
    assert "'fc.weight'" in message and "'fc.bias'" in message  # names the parameters
    assert "vescale.manual_seed(seed)" in message  # and says how to fix it
    assert two_ranks[0]["unchanged_after_weights"]


def test_lowering_errors_come_before_any_change(two_ranks):
    kind, message = two_ranks[0]["lowering"]
    assert kind == "PlanError" and "closest real paths: fc.weight" in message
    assert two_ranks[0]["unchanged_after_lowering"]


def test_parallelize_twice_is_refused(two_ranks):
    assert two_ranks[0]["twice"] == (
        "RuntimeError", "this model is already parallelized; build a fresh model to apply another plan"
    )


def test_planned_input_that_is_not_a_tensor(two_ranks):
    kind, message = two_ranks[0]["not_a_tensor"]
    assert kind == PlanError.__name__
    assert message == "shift.<in>[shift]: the plan places a tensor here, but the value is a float"
    assert two_ranks[0]["usable_after_error"]


def test_shard_dim_that_does_not_fit_an_activation(two_ranks):
    assert two_ranks[0]["shard_dim"] == (
        "PlanError", "fc.<out>[0]: Shard(2) does not fit a tensor of shape (3, 4); use a dim in [0, 2)"
    )


def test_factory_tensors_get_the_planned_placement(two_ranks):
    seen = two_ranks[0]["factory_seen"]
    assert seen["planned"] == [(Shard(0),)]
    assert seen["plain"] == ["plain"]  # unplanned: left a plain tensor, taken as global by DTensor ops


def test_factory_and_implicit_replication_match_one_device(two_ranks):
    # plain's Linear contracts over a dimension the Shard(0) positions split across the 2 ranks, so
    # its dot products are summed in two halves plus an all-reduce: float32 rounding may differ from
    # the single-device order by a few ulps of values of order 1, far below 1e-6.
    assert two_ranks[0]["factory_output_error"] < 1e-6
    assert two_ranks[0]["factory_grad_error"] < 1e-6


def test_loss_outside_the_model_full_tensor_is_the_global_loss(two_ranks):
    for r in two_ranks:
        expected, full, _ = r["outside_loss"]
        # The same 4-row mean, as two 2-row means averaged by an all-reduce: float32 rounding only.
        assert abs(full - expected) < 1e-6


def test_loss_outside_the_model_item_is_the_global_loss(two_ranks):
    for r in two_ranks:
        expected, _, item = r["outside_loss"]
        assert abs(item - expected) < 1e-6


# ---------------------------------------------------------------------------------------------
# Uneven shards: Linear(10, 6) with its 6 output rows split over 4 ranks (2, 2, 2, 0)
# ---------------------------------------------------------------------------------------------


def _train(model: nn.Module, steps) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, target in steps:
        loss = ((model(x) - target) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.full_tensor().item() if isinstance(loss, DTensor) else loss.item())
    return losses


def _uneven_training() -> dict:
    mesh = vescale.init_mesh((4,), ("TP",))
    data = torch.Generator().manual_seed(1)
    steps = [(torch.randn(5, 10, generator=data), torch.randn(5, 6, generator=data)) for _ in range(3)]
    reference = _fresh(nn.Linear, 10, 6)
    model = vescale.parallelize(_fresh(nn.Linear, 10, 6), VescalePlan().shard("weight", Shard(0), mesh="TP"), mesh)
    local_rows = model.weight.to_local().shape[0]
    expected, got = _train(reference, steps), _train(model, steps)
    return {
        "local_rows": local_rows,
        "placements": tuple(model.weight.placements),
        "loss_error": max(abs(a - b) for a, b in zip(expected, got)),
        "weight_error": (model.weight.full_tensor() - reference.weight).abs().max().item(),
        "bias_error": (model.bias.full_tensor() - reference.bias).abs().max().item(),
    }


def test_uneven_shards_train_like_one_device():
    results = run_on_ranks(_uneven_training, 4)
    assert [r["local_rows"] for r in results] == [2, 2, 2, 0]  # really uneven: rank 3 holds no row
    assert all(r["placements"] == (Shard(0),) for r in results)
    # Each output element is the same 10-term dot product as on one device; only the loss's mean
    # over the split output columns is summed in another order (per rank, then all-reduced), which
    # moves float32 results by a few ulps at most. 1e-6 is ~10 ulps at these magnitudes (< 4).
    for r in results:
        assert r["loss_error"] < 1e-6 and r["weight_error"] < 1e-6 and r["bias_error"] < 1e-6, r
