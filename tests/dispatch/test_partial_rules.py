"""``vescale.dispatch.fast.partial``: scatter keeps a Partial ``src`` Partial (the MoE router's top-k
backward), and the softmax backward a Partial gradient (the router's softmax), with the single
device's value and no communication; where the Partial strategy does not apply (a Replicate
``src``, a scalar value, in place; a gradient sharded on another dim) PyTorch's decision stands.

Values on 2 gloo ranks (a Partial(sum) whose pieces add up exactly), decisions on the fake group
against PyTorch's own propagation (``dispatch.uninstall(keep_coverage=True)``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import vescale
from vescale import dispatch
from vescale.testing import forget_dtensor_caches, run_on_ranks

aten = torch.ops.aten


def _inputs():
    g = torch.Generator().manual_seed(0)
    rows, experts, k = 6, 8, 2
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(rows)])
    src = torch.randint(-3, 4, (rows, k), generator=g).float()
    return torch.zeros(rows, experts), index, src


def _scatter_on_ranks():
    dispatch.install()
    mesh = vescale.init_mesh((dist.get_world_size(),), ("TP",))
    zeros, index, src = _inputs()
    self_ = distribute_tensor(zeros, mesh, [Replicate()])
    idx = distribute_tensor(index, mesh, [Replicate()])
    part = DTensor.from_local(src / mesh.size(), mesh, [Partial()], run_check=False)  # sums to src exactly
    with CommDebugMode() as comm:
        out = self_.scatter(-1, idx, part)
    return tuple(out.placements), comm.get_total_counts(), out.full_tensor()


def test_a_partial_src_stays_partial_with_the_single_device_value():
    zeros, index, src = _inputs()
    want = zeros.scatter(-1, index, src)
    for placements, comms, value in run_on_ranks(_scatter_on_ranks, 2):
        assert placements == (Partial(),)
        assert comms == 0
        assert torch.equal(value, want)


# ---- softmax backward: linear in the gradient ------------------------------------------------------


def _softmax_inputs():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 8, generator=g)
    grad = torch.randint(-3, 4, (6, 8), generator=g).float()  # halves add up exactly
    return torch.softmax(logits, -1), grad


def _softmax_backward_on_ranks():
    dispatch.install()
    mesh = vescale.init_mesh((dist.get_world_size(),), ("TP",))
    y, grad = _softmax_inputs()
    part = DTensor.from_local(grad / mesh.size(), mesh, [Partial()], run_check=False)
    whole = distribute_tensor(y, mesh, [Replicate()])
    with CommDebugMode() as comm:
        out = aten._softmax_backward_data(part, whole, -1, torch.float32)
    return tuple(out.placements), comm.get_total_counts(), out.full_tensor()


def test_softmax_backward_keeps_a_partial_gradient_partial_with_the_single_device_value():
    """The router's softmax backward: y * (g - sum(g * y)) is linear in g, so each rank's share of
    g gives its share of the result (the sum of the shares equals the single device's result up to
    fp32 rounding of the two halves' products: 1e-6)."""
    y, grad = _softmax_inputs()
    want = aten._softmax_backward_data(grad, y, -1, torch.float32)
    for placements, comms, value in run_on_ranks(_softmax_backward_on_ranks, 2):
        assert placements == (Partial(),)
        assert comms == 0
        assert (value - want).abs().max().item() <= 1e-6


def _decisions(mesh, fn):
    """fn's placements with vescale's dispatch and with PyTorch's own."""
    forget_dtensor_caches()
    ours = fn()
    dispatch.uninstall(keep_coverage=True)
    forget_dtensor_caches()
    try:
        theirs = fn()
    finally:
        dispatch.install()
    return ours.placements, theirs.placements


def test_without_a_partial_src_pytorchs_decision_stands(mesh):
    zeros, index, src = _inputs()
    s = lambda p: distribute_tensor(zeros, mesh, [Replicate(), p])  # noqa: E731
    idx = distribute_tensor(index, mesh, [Replicate(), Replicate()])
    val = distribute_tensor(src, mesh, [Replicate(), Replicate()])
    rows = distribute_tensor(src, mesh, [Replicate(), Shard(0)])
    for fn in (lambda: s(Replicate()).scatter(-1, idx, val), lambda: s(Shard(0)).scatter(-1, idx, rows),
               lambda: s(Shard(0)).scatter(-1, idx, 1.0)):
        ours, theirs = _decisions(mesh, fn)
        assert ours == theirs and not any(p.is_partial() for p in ours)


def test_in_place_scatter_is_not_extended(mesh):
    """scatter_ cannot make its Replicate self partial: PyTorch's rule (the src all-reduced)."""
    zeros, index, src = _inputs()
    part = DTensor.from_local(src, mesh, [Replicate(), Partial()], run_check=False)
    idx = distribute_tensor(index, mesh, [Replicate(), Replicate()])
    ours, theirs = _decisions(mesh, lambda: distribute_tensor(zeros, mesh, [Replicate(), Replicate()]).scatter_(-1, idx, part))
    assert ours == theirs == (Replicate(), Replicate())


def test_pytorchs_own_rule_moves_the_partial_src(mesh):
    """What the Partial strategy changes: PyTorch's scatter rule has no Partial strategy, so its
    search reduces the src (here a reduce-scatter over the rows)."""
    zeros, index, src = _inputs()
    part = DTensor.from_local(src, mesh, [Replicate(), Partial()], run_check=False)
    idx = distribute_tensor(index, mesh, [Replicate(), Replicate()])
    ours, theirs = _decisions(mesh, lambda: distribute_tensor(zeros, mesh, [Replicate(), Replicate()]).scatter(-1, idx, part))
    assert ours == (Replicate(), Partial())
    assert not any(p.is_partial() for p in theirs)


def test_a_partial_src_stays_partial_beside_rows_split_on_a_size_1_dim(mesh):
    """TP-only training's (DP=1, TP=2) mesh: the router's tokens are Shard(0) on the size-1 DP dim.
    The Partial strategy combines with rows split alike there, so src is not reduce-scattered (a
    Partial strategy that first moved Shard(0) off the size-1 dim cost more than PyTorch's
    reduce-scatter on two TP ranks)."""
    from torch.distributed.device_mesh import DeviceMesh

    tp_only = DeviceMesh("cpu", torch.tensor([[0, 1]]), mesh_dim_names=("DP", "TP"))
    zeros, index, src = _inputs()
    part = DTensor.from_local(src, tp_only, [Shard(0), Partial()], run_check=False)
    idx = DTensor.from_local(index, tp_only, [Shard(0), Replicate()], run_check=False)
    self_ = DTensor.from_local(zeros, tp_only, [Replicate(), Replicate()], run_check=False)
    ours, theirs = _decisions(tp_only, lambda: self_.scatter(-1, idx, part))
    assert ours[1] == Partial(), ours
    assert not theirs[1].is_partial(), theirs


def test_pytorchs_own_softmax_backward_replicates_the_partial_gradient(mesh):
    """What the Partial strategy changes: PyTorch's rule replicates the softmax dim and reduces a
    Partial gradient first; a Shard on another dim stays as PyTorch decides."""
    y, grad = _softmax_inputs()
    part = DTensor.from_local(grad, mesh, [Replicate(), Partial()], run_check=False)
    out = distribute_tensor(y, mesh, [Replicate(), Replicate()])
    ours, theirs = _decisions(mesh, lambda: aten._softmax_backward_data(part, out, -1, torch.float32))
    assert ours == (Replicate(), Partial())
    assert not any(p.is_partial() for p in theirs)
    rows = distribute_tensor(grad, mesh, [Replicate(), Shard(0)])
    out_rows = distribute_tensor(y, mesh, [Replicate(), Shard(0)])
    ours, theirs = _decisions(mesh, lambda: aten._softmax_backward_data(rows, out_rows, -1, torch.float32))
    assert ours == theirs == (Replicate(), Shard(0))
