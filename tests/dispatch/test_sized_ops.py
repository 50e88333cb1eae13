"""``vescale.dispatch.fast.sized``: ops with size arguments replayed from a table of PyTorch's decisions.

Each case runs an op on DTensors of a (DP=2, TP=2) fake mesh twice with the handler (the second call
a table hit) and once with PyTorch's own dispatch (the handler out of DTensor's table, caches
cleared), and requires equal placements, global shape and stride, bit-identical local shards, and
that the hit asked no propagator. Gradients through views are compared the same way (the fake
group's collectives do not communicate, so rank 0's local tensors are compared, not global ones;
``tests/zoo/test_moe_parallel.py`` checks whole models against one device on gloo ranks). A view
aliases its base; a decision that moves an input stays on PyTorch's path.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from vescale import dispatch
from vescale.dispatch.fast import sized
from vescale.dispatch.coverage import attention
from vescale.dispatch.local import handler_runs_locally
from vescale.testing import forget_dtensor_caches

aten = torch.ops.aten



def _dt(mesh, shape, placements, seed=0):
    full = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return distribute_tensor(full, mesh, placements)


class _CountDecisions:
    """Counts how often the handler asks PyTorch for a decision (a table miss)."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = sized._decide

        def counted(*a):
            self.n += 1
            return real(*a)

        monkeypatch.setattr(sized, "_decide", counted)


def _pytorch(fn, *args):
    """``fn`` with DTensor's own path for the sized ops (the handler taken out, caches cleared)."""
    table = DTensor._op_dispatcher._custom_op_handlers
    taken = {op: table.pop(op) for op in list(table) if table[op] is sized.sized_op_handler}
    forget_dtensor_caches()
    try:
        return fn(*args)
    finally:
        table.update(taken)


def _same(ours: DTensor, theirs: DTensor):
    assert ours.placements == theirs.placements
    assert ours.shape == theirs.shape and ours.stride() == theirs.stride()
    assert ours._local_tensor.shape == theirs._local_tensor.shape
    assert ours._local_tensor.stride() == theirs._local_tensor.stride()
    assert torch.equal(ours._local_tensor, theirs._local_tensor)


CASES = {
    # view splitting a sharded dim's neighbour: the size argument is rewritten to local sizes
    "view heads": (lambda x: x.view(8, 16, 4, 8), (8, 16, 32), (Shard(0), Shard(2))),
    "view flatten": (lambda x: x.view(128, 32), (8, 16, 32), (Shard(0), Replicate())),
    "_unsafe_view": (lambda x: aten._unsafe_view.default(x, [8, 16, 4, 8]), (8, 16, 32), (Shard(0), Shard(2))),
    "view partial": (lambda x: x.view(128, 32), (8, 16, 32), (Replicate(), Partial())),
    "expand": (lambda x: x.expand(8, 4, 16, 8), (8, 1, 16, 8), (Shard(0), Shard(2))),
    "slice_backward": (lambda x: aten.slice_backward.default(x, [8, 4, 16, 16], 3, 8, 16, 1), (8, 4, 16, 8), (Shard(0), Shard(1))),
    "new_zeros": (lambda x: x.new_zeros([8, 16, 32]), (8, 16, 32), (Shard(0), Shard(1))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_hit_gives_pytorch_answer(mesh, monkeypatch, name):
    fn, shape, placements = CASES[name]
    x = _dt(mesh, shape, placements)
    sized.clear_sized_ops_table()
    counter = _CountDecisions(monkeypatch)
    first = fn(x)
    second = fn(x)  # a table hit
    assert counter.n == 1, "the repeated call asked for a decision again"
    theirs = _pytorch(fn, x)
    _same(first, theirs)
    _same(second, theirs)


def test_hit_asks_no_propagator(mesh, monkeypatch):
    x = _dt(mesh, (8, 16, 32), (Shard(0), Shard(2)))
    x.view(8, 16, 4, 8)
    prop = DTensor._op_dispatcher.sharding_propagator
    calls = []
    monkeypatch.setattr(prop, "propagate_op_sharding_non_cached", lambda s: calls.append(s))
    y = x.view(8, 16, 4, 8)
    assert calls == [] and y._local_tensor.shape == (4, 16, 2, 8)


def test_view_aliases_its_base(mesh):
    x = _dt(mesh, (8, 16, 32), (Shard(0), Shard(2)))
    x.view(8, 16, 4, 8)  # learn
    before = x._local_tensor.clone()
    y = x.view(8, 16, 4, 8)
    y.add_(1.0)  # through the view: the base changes too
    assert torch.equal(x._local_tensor, before + 1.0)
    assert y._local_tensor.untyped_storage().data_ptr() == x._local_tensor.untyped_storage().data_ptr()


def _grads(mesh, full, w):
    """Local gradients (and placements) of a function of views and expands, run twice (the second
    run: every sized op a table hit when the handler is installed)."""
    out = []
    for _ in range(2):
        x = distribute_tensor(full, mesh, (Shard(0), Shard(2))).requires_grad_()
        wd = distribute_tensor(w, mesh, (Shard(0), Replicate())).requires_grad_()
        heads = x.view(8, 16, 4, 8).transpose(1, 2)  # (8, 4, 16, 8)
        (heads * wd.expand(8, 4, 16, 8)).reshape(8, 4, 128).sum().backward()
        out.append((x.grad, wd.grad))
    return out


def test_gradients_through_views_match_pytorch(mesh):
    torch.manual_seed(0)
    full, w = torch.randn(8, 16, 32), torch.randn(8, 1, 16, 8)
    sized.clear_sized_ops_table()
    ours = _grads(mesh, full, w)
    assert sized._TABLE, "the sized ops did not go through the handler"
    (theirs, _) = _pytorch(_grads, mesh, full, w)
    for got in ours:
        for a, b in zip(got, theirs):
            _same(a, b)


def test_moving_decision_stays_on_pytorch_path(mesh):
    """Splitting an unevenly sharded dim gathers it first: kept as PyTorch's path, same answer."""
    x = _dt(mesh, (6, 8), (Replicate(), Shard(0)))  # 3 rows per TP rank
    fn = lambda t: t.view(3, 2, 8)  # noqa: E731  the sharded dim split into (3, 2): 3 does not divide by TP=2
    sized.clear_sized_ops_table()
    ours = fn(x)
    (entry,) = sized._TABLE.values()
    assert entry[0] is sized._SLOW
    _same(fn(x), ours)
    _same(ours, _pytorch(fn, x))


def test_table_is_bounded(mesh, monkeypatch):
    monkeypatch.setattr(sized._TABLE, "limit", 3)
    sized.clear_sized_ops_table()
    x = _dt(mesh, (8, 16, 32), (Shard(0), Shard(2)))
    for n in (2, 4, 8, 16):
        x.view(8, 16, n, 32 // n)
    assert len(sized._TABLE) <= 3


def test_static_eager_question(mesh):
    """The handler runs locally (``handler_runs_locally``) where DTensor's rule does for ops without a handler."""
    x = _dt(mesh, (8, 16, 32), (Shard(0), Shard(2)))
    assert handler_runs_locally(sized.sized_op_handler, aten.view.default, (x, [8, 16, 4, 8]), {})
    y = _dt(mesh, (6, 8), (Replicate(), Shard(0)))
    assert not handler_runs_locally(sized.sized_op_handler, aten.view.default, (y, [3, 2, 8]), {})


def test_uninstall_gives_pytorch_path_back(mesh):
    table = DTensor._op_dispatcher._custom_op_handlers
    dispatch.uninstall(keep_coverage=True)
    try:
        assert all(h is not sized.sized_op_handler for h in table.values())
        assert not sized._TABLE
    finally:
        dispatch.install()
    assert table[aten.view.default] is sized.sized_op_handler


def test_sdpa_repeated_call_reuses_its_decision(mesh, monkeypatch):
    """The CPU SDPA handler runs the meta kernel once per call signature; a repeat gives equal outputs."""
    q, k, v = (_dt(mesh, (4, 4, 16, 8), (Shard(0), Shard(1)), seed=s) for s in range(3))
    attention.clear_sdpa_decisions()
    decisions = []
    real = attention._sdpa_decision
    monkeypatch.setattr(attention, "_sdpa_decision", lambda *a: decisions.append(1) or real(*a))
    first = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    second = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert len(decisions) == 1
    _same(second, first)
    assert second.placements == (Shard(0), Shard(1)) and second.shape == (4, 4, 16, 8)
    local = torch.nn.functional.scaled_dot_product_attention(q._local_tensor, k._local_tensor, v._local_tensor, is_causal=True)
    assert torch.equal(second._local_tensor, local)  # batch and heads split: the kernel on local shards
