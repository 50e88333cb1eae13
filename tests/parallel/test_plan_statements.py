"""plan.redistribute and plan.annotate in eager mode, on 2 gloo ranks (TP=2).

* ``redistribute`` with only src/dst does exactly what ``plan.shard`` of the activation does (the
  same values, gradients and collectives), and refuses a tensor that arrives laid out otherwise;
  ``grad_dst`` / ``grad_src`` change where the gradient goes in backward (checked by its placements,
  its value and the number of collectives).
* ``annotate`` of an activation checks a DTensor, and takes a plain tensor as this rank's local
  shard: dropout inside the module then draws this shard's part of the single-device numbers (bits).
* ``annotate("<param>.grad", ...)`` is checked against the gradient the module computes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import vescale
from vescale.debug import CollectiveCounter
from vescale.plan.ir import PlanError
from vescale.random import consistent
from vescale.testing import error_of, run_on_ranks


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


def _tp_plan(out=None):
    """Megatron MLP; the row-parallel output (Partial) is moved by ``out(plan)``, by default to
    Shard(0) (the batch), so the norm's weight gradient is Partial."""
    plan = vescale.VescalePlan()
    plan.shard(r"up\.(weight|bias)", Shard(0), mesh="TP").shard(r"down\.weight", Shard(1), mesh="TP")
    (out or (lambda p: p.shard(r"down\.<out>", Shard(0), mesh="TP")))(plan)
    return plan


def _step(plan, x_placements=None, grad=True):
    """One forward/backward of a fresh MLP (same weights on every rank); returns the output, the
    gradients (full tensors), the input's gradient and the collectives of the step."""
    torch.manual_seed(0)
    model = MLP()
    mesh = vescale.init_mesh((2,), ("TP",))
    vescale.parallelize(model, plan, mesh)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    if x_placements is not None:  # a DTensor input whose gradient we can look at
        x = distribute_tensor(x, mesh, x_placements).requires_grad_(True)
    with CollectiveCounter() as c:
        out = model(x)
        if grad:
            out.sum().backward() if not isinstance(out, DTensor) else out.full_tensor().sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    x_grad = None if x_placements is None else (x.grad.placements, x.grad.full_tensor())
    return out.full_tensor().detach(), grads, x_grad, dict(c.counts)


def _same_as_shard():
    shard = _step(_tp_plan())
    redist = _step(_tp_plan(lambda p: p.redistribute(r"down\.<out>", Partial(), Shard(0), mesh="TP")))
    return shard, redist


@pytest.mark.multiproc
def test_redistribute_does_what_shard_does():
    (out_a, grads_a, _, coll_a), (out_b, grads_b, _, coll_b) = run_on_ranks(_same_as_shard, 2)[0]
    assert torch.equal(out_a, out_b)
    assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    assert coll_a == coll_b and coll_a.get("reduce_scatter", 0) >= 1, coll_a


def _wrong_source():
    return error_of(_step, _tp_plan(lambda p: p.redistribute(r"down\.<out>", Shard(0), Replicate(), mesh="TP")), kind=PlanError)


@pytest.mark.multiproc
def test_redistribute_refuses_a_tensor_that_arrives_otherwise():
    message = run_on_ranks(_wrong_source, 2)[0]
    assert message is not None, "a wrong source placement was accepted"
    assert "down.<out>[0]" in message and "statement(s) #2" in message, message
    assert "redistribute(s) it from [S(0)] but it arrives as [P(sum)]" in message, message


def _grad_placements():
    x_rep = [Replicate()]

    def with_input(**grads):
        return _tp_plan(lambda p: p.shard(r"down\.<out>", Shard(0), mesh="TP")
                        .redistribute(r"up\.<in>", Replicate(), Replicate(), mesh="TP", **grads))

    # A Replicate leaf's gradient through a column-parallel Linear is Partial (DTensor reduces it
    # only when asked); a redistribute can reduce it on arrival (grad_src) or on leaving (grad_dst).
    return [_step(_tp_plan(), x_rep)] + [
        _step(with_input(**grads), x_rep)
        for grads in ({"grad_src": Replicate()}, {"grad_dst": Replicate()}, {"grad_dst": Partial()})
    ]


@pytest.mark.multiproc
def test_grad_src_and_grad_dst_move_the_gradient_as_stated():
    default, arrived, left, unreduced = run_on_ranks(_grad_placements, 2)[0]
    assert default[2][0] == (Partial(),)
    assert arrived[2][0] == (Replicate(),) and left[2][0] == (Replicate(),) and unreduced[2][0] == (Partial(),)
    for run in (arrived, left, unreduced):  # the same gradient, reduced in backward or by full_tensor
        assert torch.equal(run[2][1], default[2][1])
    assert arrived[3]["all_reduce"] == left[3]["all_reduce"] == default[3]["all_reduce"] + 1, (arrived[3], default[3])
    assert unreduced[3] == default[3]


class Drop(nn.Module):
    def forward(self, x):
        return F.dropout(x, p=0.5, training=True) * 3.0


def _annotated_dropout():
    mesh = vescale.init_mesh((2,), ("TP",))
    plan = vescale.VescalePlan().annotate("<in>[x]", Shard(0), mesh="TP")
    model = vescale.parallelize(Drop(), plan, mesh)
    full = torch.randn(6, 5, generator=torch.Generator().manual_seed(3))
    vescale.manual_seed(7)
    out = model(full.chunk(2)[dist.get_rank()].clone())  # each rank holds its half, as a plain tensor
    vescale.manual_seed(7)
    with consistent():
        ref = F.dropout(full, p=0.5, training=True) * 3.0
    return out.placements, out.to_local(), ref.chunk(2)[dist.get_rank()]


@pytest.mark.multiproc
def test_annotate_takes_a_plain_tensor_as_its_local_shard_and_dropout_draws_single_device_bits():
    for placements, local, ref in run_on_ranks(_annotated_dropout, 2):
        assert placements == (Shard(0),)
        assert torch.equal(local, ref)


def _annotate_errors():
    messages = [
        error_of(_step, plan, kind=PlanError)
        for plan in (
            _tp_plan().annotate(r"norm\.<in>", Replicate(), mesh="TP"),  # it is Shard(0)
            _tp_plan().annotate(r"norm\.weight\.grad", Replicate(), mesh="TP"),  # it is Partial
        )
    ]
    ok = _step(_tp_plan().annotate(r"norm\.weight\.grad", Partial(), mesh="TP").annotate(r"norm\.<in>", Shard(0), mesh="TP"))
    return messages, ok[0]


@pytest.mark.multiproc
def test_annotations_that_disagree_with_the_model_are_errors():
    (activation, grad), _ = run_on_ranks(_annotate_errors, 2)[0]
    assert activation is not None and "norm.<in>[input]" in activation and "as [R]" in activation and "[S(0)]" in activation, activation
    assert grad is not None and "the gradient of 'norm.weight' is [P(sum)]" in grad and "annotate it as [R]" in grad, grad


def test_statements_are_checked_when_written():
    plan = vescale.VescalePlan()
    with pytest.raises(ValueError, match="annotate names an activation .* or a parameter's gradient"):
        plan.annotate(r"up\.weight", Shard(0), mesh="TP")
    with pytest.raises(ValueError, match="redistribute names an activation"):
        plan.redistribute(r"up\.weight", Shard(0), Replicate(), mesh="TP")
    with pytest.raises(ValueError, match="grad_src gives 2 placement"):
        plan.redistribute(r"up\.<in>", Shard(0), Replicate(), grad_src=[Shard(0), Replicate()], mesh="TP")
    assert plan.statements == []  # a refused statement leaves nothing behind
    plan.redistribute(r"up\.<in>", [Shard(0)], [Replicate()], grad_dst=[Partial()])
    assert str(plan.statements[0]) == r"#0 plan.redistribute('up\\.<in>', S(0), R, grad_dst=P(sum))"
