"""A sharding rule a user adds for their own op (PyTorch's ``register_sharding``) works with vescale.

``vescale/dispatch`` adds no rule API of its own: a user's op gets its rule from PyTorch's
``torch.distributed.tensor.experimental.register_sharding``, and vescale's dispatch serves it like
PyTorch's own rules (docs/dispatch.md, "Adding a rule for your op"). Checked here with a custom op
(``torch.library.custom_op``, a row scaling ``x * w[:, None]`` whose rule keeps rows sharded):

* eager, fake 4-rank world: the output is row-sharded, its local values are the op on the local
  shards, and a new number of rows is a hit of the shape-free cache (no second miss);
* on 2 gloo ranks (DP=2, batch rows split), a model whose head calls the op (and averages over the
  batch) trains in eager and Static Eager mode within 1e-6 of the single device (fp32 means over
  two ranks sum in another order), each rank's head gets its half of the batch, and in Static
  Eager mode every module runs static (the rule moves nothing, so the recording takes the op as
  local: ``eager_modules`` is empty).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

import vescale
from vescale import dispatch
from vescale.testing import fake_world, global_value, run_on_ranks, sgd_steps
from vescale.model_state import state_of


@torch.library.custom_op("vescale_test::row_scale", mutates_args=())
def row_scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w[:, None]


@row_scale.register_fake
def _(x, w):
    return torch.empty_like(x)


def _row_scale_backward(ctx, grad):
    x, w = ctx.saved_tensors
    return grad * w[:, None], (grad * x).sum(-1)


row_scale.register_autograd(_row_scale_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


@register_sharding(torch.ops.vescale_test.row_scale.default)
def _row_scale_sharding(x, w):
    # (output placements, input placements) per mesh dim: rows split alike, or everything whole
    return [([Shard(0)], [Shard(0), Shard(0)]), ([Replicate()], [Replicate(), Replicate()])]


def test_a_registered_rule_decides_and_a_new_length_is_a_hit():
    with fake_world(4):
        mesh = vescale.init_mesh((4,), ("TP",))
        dispatch.install()
        cache = dispatch.shape_free_cache()
        for step, rows in enumerate((8, 12, 16)):
            x = DTensor.from_local(torch.randn(rows // 4, 5), mesh, [Shard(0)], run_check=False)
            w = DTensor.from_local(torch.randn(rows // 4), mesh, [Shard(0)], run_check=False)
            hits, misses = cache.hits, cache.misses
            y = torch.ops.vescale_test.row_scale(x, w)
            assert y.placements == (Shard(0),) and y.shape == (rows, 5)
            assert torch.equal(y.to_local(), x.to_local() * w.to_local()[:, None])
            if step:  # a new row count: the first length's decision, replayed
                assert (cache.hits - hits, cache.misses - misses) == (1, 0)


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, x):
        h = self.lin(x)  # rows sharded over DP
        return torch.ops.vescale_test.row_scale(h, h.sum(-1).sigmoid()).square().mean()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = Head()

    def forward(self, x):
        return self.head(x)


STEPS, TOL = 4, 1e-6


def _batches():
    g = torch.Generator().manual_seed(2)
    return [torch.randn(8, 5, generator=g) for _ in range(STEPS)]


def _train(model) -> dict:
    run = sgd_steps(model, [(x,) for x in _batches()], lr=0.1)
    return {**run, "weight": global_value(model.head.lin.weight)}


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _distributed():
    mesh = vescale.init_mesh((2,), ("DP",))
    out = {}
    for mode in ("eager", "static"):
        model = _net()
        plan = vescale.VescalePlan()
        plan.shard(r"<in>\[x\]", Shard(0), mesh="DP")
        vescale.parallelize(model, plan, mesh, mode=mode)
        rows = []  # the rows the head's body gets: this rank's half of the batch
        model.head.register_forward_pre_hook(
            lambda m, a: rows.append(tuple((a[0]._local_tensor if isinstance(a[0], DTensor) else a[0]).shape)))
        out[mode] = _train(model)
        out[mode]["rows"] = set(rows)
        if mode == "static":
            out["eager_modules"] = vescale.static.eager_modules(model)
            out["static_steps"] = state_of(model).static.static_steps
    return out


@pytest.mark.multiproc
def test_a_model_using_the_op_trains_like_one_device_and_runs_static():
    ref = _train(_net())
    for rank, got in enumerate(run_on_ranks(_distributed, 2)):
        assert got["eager_modules"] == {}, (rank, got["eager_modules"])
        assert got["static_steps"] >= STEPS - 1, (rank, got["static_steps"])
        for mode in ("eager", "static"):
            assert got[mode]["rows"] == {(4, 5)}, (rank, mode, got[mode]["rows"])  # the batch of 8 split
            for step, (a, b) in enumerate(zip(got[mode]["losses"], ref["losses"])):
                assert abs(a - b) <= TOL * abs(b), (rank, mode, step, a, b)
            assert (got[mode]["weight"] - ref["weight"]).abs().max().item() <= TOL, (rank, mode)
