"""The shape-free sharding cache at a new sequence length: the decision learned at one size is reused
at another (a cache hit) and equals PyTorch's own propagation there; where the decision depends on
the sizes (uneven shards, split factors), it is not reused.

Each comparison runs the op with vescale's extensions (after a run at another size taught the cache)
and with PyTorch's own dispatch (``dispatch.uninstall(keep_coverage=True)``, caches cleared), and requires equal
placements, global shape and stride, and bit-identical local shards. ``vescale.dispatch.metas``'s
arithmetic output metadata is compared with PyTorch's FakeTensor propagation directly.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
import torch.testing._internal.distributed.fake_pg  # noqa: F401
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from vescale import dispatch
from vescale.placement import InterleavedShard
from vescale.dispatch.fast.cache import _key
from vescale.dispatch.metas import fast_outputs, miss_outputs
from vescale.testing import forget_dtensor_caches

aten = torch.ops.aten



def _dt(mesh, shape, placements, seed=0, dtype=torch.float32):
    """Rank 0's shard of a seeded global tensor (uneven shards included: DTensor's own chunking)."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(shape, generator=g).to(dtype) if dtype.is_floating_point else torch.randint(0, 8, shape, generator=g)
    local_shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    local = full
    for d, (n, o) in enumerate(zip(local_shape, offset)):
        local = local.narrow(d, o, n)
    return DTensor.from_local(local.contiguous(), mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def _same(ours, theirs):
    outs, refs = (ours, theirs) if isinstance(ours, tuple) else ((ours,), (theirs,))
    for a, b in zip(outs, refs):
        assert a.placements == b.placements, f"placements {a.placements} vs PyTorch's {b.placements}"
        assert a.shape == b.shape and a.stride() == b.stride(), f"{a.shape}/{a.stride()} vs {b.shape}/{b.stride()}"
        assert a._spec.tensor_meta == b._spec.tensor_meta, f"{a._spec.tensor_meta} vs PyTorch's {b._spec.tensor_meta}"
        assert a._local_tensor.shape == b._local_tensor.shape and a._local_tensor.stride() == b._local_tensor.stride()
        assert torch.equal(a._local_tensor, b._local_tensor)


def _learn_then_reuse(mesh, fn, learn_size, new_size):
    """fn(size) at learn_size (teaches the cache), then at new_size with PyTorch's own caches
    cleared; returns (result, shape-free hits at new_size, misses at new_size, PyTorch's result)."""
    forget_dtensor_caches()
    dispatch.install()
    cache = dispatch.shape_free_cache()
    fn(learn_size)
    _clear_sharding_prop_cache()  # PyTorch's shape-keyed cache forgotten; vescale's kept
    hits, misses = cache.hits, cache.misses
    ours = fn(new_size)
    hits, misses = cache.hits - hits, cache.misses - misses
    forget_dtensor_caches()
    dispatch.uninstall(keep_coverage=True)
    try:
        theirs = fn(new_size)
    finally:
        dispatch.install()
    return ours, hits, misses, theirs


# --- views whose flattened or split dims change size ------------------------------------------


VIEWS = {
    # LLaMA's (batch, seq, hidden) -> (batch*seq, hidden) before a linear, batch-sharded on DP
    "flatten, batch sharded": (lambda s, m: _dt(m, (4, s, 16), (Shard(0), Replicate()), s).view(4 * s, 16)),
    # ... with the hidden dim sharded on TP: the size argument is rewritten to local sizes
    "flatten, batch and hidden sharded": (lambda s, m: _dt(m, (4, s, 16), (Shard(0), Shard(2)), s).view(4 * s, 16)),
    # the linear's output back to (batch, seq, hidden): a split of the flattened dim
    "split, batch and hidden sharded": (lambda s, m: _dt(m, (4 * s, 16), (Shard(0), Shard(1)), s).view(4, s, 16)),
    # a head split: (batch, seq, hidden) -> (batch, seq, heads, head_dim), -1 inferred
    "head split": (lambda s, m: _dt(m, (4, s, 16), (Shard(0), Shard(2)), s).view(4, s, -1, 4)),
}


@pytest.mark.parametrize("case", list(VIEWS))
def test_a_view_learned_at_one_length_is_a_hit_at_another_with_pytorchs_answer(mesh, case):
    fn = VIEWS[case]
    ours, hits, misses, theirs = _learn_then_reuse(mesh, lambda s: fn(s, mesh), 6, 10)
    assert hits == 1 and misses == 0, f"{case}: {hits} hits, {misses} misses at a new length"
    _same(ours, theirs)


def test_a_view_whose_split_factor_changes_is_not_reused(mesh):
    """Flattening (batch, seq) with seq sharded gives _StridedShard(0, split_factor=batch): a new
    batch size is a new decision, so a new key (a miss), never the old split factor."""
    fn = lambda b: _dt(mesh, (b, 6, 8), (Replicate(), Shard(1)), b).view(b * 6, 8)  # noqa: E731
    ours, hits, misses, theirs = _learn_then_reuse(mesh, fn, 4, 3)
    assert hits == 0 and misses == 1
    assert ours.placements[1].split_factor == 3
    _same(ours, theirs)
    ours, hits, _, theirs = _learn_then_reuse(mesh, lambda s: _dt(mesh, (4, s, 8), (Replicate(), Shard(1)), s).view(4 * s, 8), 6, 10)
    assert hits == 1  # the sequence length does not enter the split factor: reused
    _same(ours, theirs)


def test_an_uneven_flatten_is_not_reused(mesh):
    """A batch the DP mesh dim does not divide cannot stay Shard(0) through a flatten: PyTorch's
    strict view refuses (redistribute first). Learned on an even batch, the uneven one must not be
    served the even one's decision (a silently wrong Shard(0) of the flattened rows)."""
    fn = lambda b: _dt(mesh, (b, 6, 8), (Shard(0), Replicate()), b).view(b * 6, 8)  # noqa: E731
    forget_dtensor_caches()
    cache = dispatch.shape_free_cache()
    assert fn(4).placements == (Shard(0), Replicate())
    hits = cache.hits
    with pytest.raises(RuntimeError, match="unevenly sharded"):
        fn(3)
    assert cache.hits == hits, "an uneven flatten was served from the even one's decision"
    dispatch.uninstall(keep_coverage=True)
    forget_dtensor_caches()
    try:
        with pytest.raises(RuntimeError, match="unevenly sharded"):
            fn(3)
    finally:
        dispatch.install()


# --- split (rotary embedding's halves; vescale's interleaved rule passes plain tensors through) ----


def test_a_split_learned_at_one_length_is_a_hit_at_another_with_pytorchs_answer(mesh):
    fn = lambda s: _dt(mesh, (4, s, 8), (Shard(0), Shard(1)), s).split(4, -1)  # noqa: E731
    ours, hits, misses, theirs = _learn_then_reuse(mesh, fn, 6, 10)
    assert hits == 1 and misses == 0
    _same(ours, theirs)


def test_a_split_of_the_sharded_dim_is_reused_only_with_as_many_pieces(mesh):
    """Splitting the sequence-sharded dim gathers it first (PyTorch's rule); the replay carries
    that redistribution. A length that gives another number of pieces is not served."""
    fn = lambda s: _dt(mesh, (4, s, 8), (Shard(0), Shard(1)), s).split(4, 1)  # noqa: E731
    ours, hits, misses, theirs = _learn_then_reuse(mesh, fn, 8, 6)  # 4+4, then 4+2
    assert hits == 1 and misses == 0
    assert all(o.placements == (Shard(0), Replicate()) for o in ours)
    _same(ours, theirs)
    ours, hits, misses, theirs = _learn_then_reuse(mesh, fn, 8, 12)  # 4+4, then 4+4+4
    assert hits == 0 and misses == 1 and len(ours) == 3
    _same(ours, theirs)


def _reused_vs_decided_afresh(fn, learn_size, new_size):
    """fn(size) at learn_size, then at new_size with PyTorch's cache cleared (vescale's kept); then
    at new_size again with every cache cleared, so that vescale's rules decide it afresh (ops whose
    placements PyTorch's own rules do not handle: interleaved shards). Returns (reused, hits,
    misses, afresh)."""
    forget_dtensor_caches()
    cache = dispatch.shape_free_cache()
    fn(learn_size)
    _clear_sharding_prop_cache()
    hits, misses = cache.hits, cache.misses
    ours = fn(new_size)
    hits, misses = cache.hits - hits, cache.misses - misses
    forget_dtensor_caches()
    return ours, hits, misses, fn(new_size)


def test_a_split_into_interleaved_sections_is_a_hit_at_a_new_length(mesh):
    """The experts' fused gate|up output (tokens, 2 * inter), interleaved over TP, split into its two
    sections: local at every token count, each section a Shard; reused at a new count. Another
    width of the split dim is another decision (a miss), never the learned one."""
    fn = lambda n: _dt(mesh, (n, 16), (Replicate(), InterleavedShard(1, 2)), n).split(8, -1)  # noqa: E731
    ours, hits, misses, afresh = _reused_vs_decided_afresh(fn, 6, 10)
    assert hits == 1 and misses == 0
    assert all(o.placements == (Replicate(), Shard(1)) for o in ours) and ours[0]._local_tensor.shape == (10, 4)
    _same(ours, afresh)
    wider = lambda w: _dt(mesh, (6, w), (Replicate(), InterleavedShard(1, 2)), w).split(w // 2, -1)  # noqa: E731
    ours, hits, misses, afresh = _reused_vs_decided_afresh(wider, 16, 24)
    assert hits == 0 and misses == 1
    _same(ours, afresh)


def test_a_cat_into_interleaved_sections_is_a_hit_at_a_new_length_only_for_equal_pieces(mesh):
    """The backward of that split: cat of two equally shaped Shard(1) pieces is InterleavedShard(1, 2)
    (vescale's rule, no communication), reused at a new token count; pieces of different widths
    are another key (PyTorch's rule gathers), never served the interleaved decision."""
    def cat(n, widths=(8, 8)):
        pieces = [_dt(mesh, (n, w), (Replicate(), Shard(1)), n + w) for w in widths]
        return torch.cat(pieces, dim=1)

    ours, hits, misses, afresh = _reused_vs_decided_afresh(cat, 6, 10)
    assert hits == 1 and misses == 0 and ours.placements == (Replicate(), InterleavedShard(1, 2))
    _same(ours, afresh)
    ours, hits, misses, afresh = _reused_vs_decided_afresh(lambda n: cat(n, (8, 16) if n == 10 else (8, 8)), 6, 10)
    assert hits == 0 and ours.placements != (Replicate(), InterleavedShard(1, 2))
    _same(ours, afresh)


@pytest.mark.parametrize("placements", [(Shard(0), Partial()), (Shard(0), Shard(1))], ids=["Partial", "Shard"])
def test_a_squeeze_is_a_hit_at_a_new_length_with_pytorchs_answer(mesh, placements):
    """squeeze(dim) rewritten to squeeze.dims of the globally singleton dims (PyTorch's rewrite, replayed
    from the key's size classes); a dim that is not of size 1 is left, at both lengths."""
    for dim in (2, 1):
        fn = lambda s: _dt(mesh, (4, s, 1), placements, s).squeeze(dim)  # noqa: E731, B023
        ours, hits, misses, theirs = _learn_then_reuse(mesh, fn, 6, 10)
        assert hits == 1 and misses == 0
        assert ours.ndim == (2 if dim == 2 else 3)
        _same(ours, theirs)


# --- the loss ops: decisions that redistribute --------------------------------------------------


def _loss(mesh, n, reduction="mean"):
    logits = _dt(mesh, (n, 16), (Shard(0), Shard(1)), n).requires_grad_()
    target = _dt(mesh, (n,), (Shard(0), Replicate()), n + 1, dtype=torch.int64)
    loss = F.cross_entropy(logits, target, reduction=reduction)
    loss.backward()
    return loss, logits.grad


def test_the_loss_ops_are_hits_at_a_new_length_with_pytorchs_answer(mesh):
    """log_softmax gathers the vocabulary-sharded logits, nll_loss_backward replicates its Partial
    gradient: redistributions whose placements depend on placements alone (one-strategy rules)."""
    ours, hits, misses, theirs = _learn_then_reuse(mesh, lambda n: _loss(mesh, n), 8, 12)
    assert misses == 0, f"{misses} misses in a cross-entropy forward and backward at a new length"
    assert hits >= 4  # _log_softmax, nll_loss_forward, nll_loss_backward, _log_softmax_backward_data
    _same(ours, theirs)


def test_an_uneven_target_is_refused_like_pytorch_after_an_even_one(mesh):
    """PyTorch's rule for nll_loss's mean refuses a target the DP dim splits unevenly (a biased mean
    otherwise); the decision learned on an even batch must not hide that. (vescale's own handler
    for the mean over a split batch, which computes it right, is taken out here: the question is
    the cache's key for PyTorch's rule; tests/dispatch/test_loss_semantics.py covers the handler.)"""
    forget_dtensor_caches()
    handlers = DTensor._op_dispatcher._custom_op_handlers
    ours = handlers.pop(aten.nll_loss_forward.default)
    try:
        _loss(mesh, 8)
        _clear_sharding_prop_cache()
        with pytest.raises(RuntimeError, match="evenly sharded"):
            _loss(mesh, 7)
    finally:
        handlers[aten.nll_loss_forward.default] = ours
    a = _dt(mesh, (8, 16), (Shard(0), Shard(1)))
    b = _dt(mesh, (7, 16), (Shard(0), Shard(1)))
    t8, t7 = (_dt(mesh, (n,), (Shard(0), Replicate()), 0, dtype=torch.int64) for n in (8, 7))
    s = lambda x, t: OpSchema(aten.nll_loss_forward.default, (x._spec, t._spec, None, 1, -100), {})  # noqa: E731
    assert _key(s(a, t8)) != _key(s(b, t7))


# --- keys and arithmetic metadata ---------------------------------------------------------------


def test_the_key_keeps_whether_the_mesh_divides_and_covers_each_sharded_dim(mesh):
    x = lambda n: _dt(mesh, (n, 8), (Shard(0), Replicate()))  # noqa: E731
    s = lambda t: OpSchema(aten.add.Tensor, (t._spec, t._spec), {})  # noqa: E731
    assert _key(s(x(6))) == _key(s(x(10))), "sizes the mesh divides must share a key"
    assert _key(s(x(6))) != _key(s(x(7))), "an uneven shard must not share the even one's key"
    y = lambda n: _dt(mesh, (8, n), (Replicate(), Shard(1)))  # noqa: E731
    assert _key(s(y(3))) == _key(s(y(5)))
    assert _key(s(y(3))) != _key(s(y(4)))


def _spec(mesh, shape, stride=None, dtype=torch.float32):
    stride = stride or torch.empty(shape, device="meta").stride()
    return DTensorSpec(mesh, (Replicate(), Replicate()), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype))


def _meta_cases(mesh):
    """(op, args) pairs over shapes with size-1 dims, broadcasts and transposed strides."""
    s = lambda *a, **k: _spec(mesh, *a, **k)  # noqa: E731
    cases = []
    for shape in [(4, 6, 8), (4, 1, 8), (1, 6, 1), (8,), ()]:
        cases += [(aten.add.Tensor, (s(shape), s(shape))), (aten.mul.Tensor, (s(shape), 2.0)),
                  (aten.neg.default, (s(shape),)), (aten.rsqrt.default, (s(shape),)),
                  (aten.detach.default, (s(shape),)), (aten.clone.default, (s(shape),))]
    for a, b in [((4, 6, 8), (8,)), ((4, 6, 8), (4, 6, 1)), ((4, 6, 8), (1, 6, 8)), ((1, 6, 8), (4, 1, 8)), ((4, 1, 8), (4, 1, 8))]:
        cases += [(aten.mul.Tensor, (s(a), s(b))), (aten.sub.Tensor, (s(b), s(a)))]
    t = s((4, 8, 6), (48, 1, 8))  # a transposed (4, 6, 8)
    cases += [(aten.add.Tensor, (t, t)), (aten.mul.Tensor, (t, s((4, 8, 6)))), (aten.neg.default, (t,)),
              (aten.silu.default, (t,)), (aten.mul.Tensor, (t, s((8, 1))))]
    # rotary embedding: heads-first views of (batch, seq, heads, dim), their halves, broadcast cos/sin
    q = s((2, 4, 6, 8), (192, 8, 32, 1))
    half = s((2, 4, 6, 4), (192, 8, 32, 1))
    back = s((2, 4, 6, 8), (192, 48, 1, 6))  # a transposed gradient
    for x in (q, half, back):
        n = x.tensor_meta.shape[-1]
        cases += [(aten.mul.Tensor, (x, s((1, 1, 6, n)))), (aten.neg.default, (x,)), (aten.mul.Tensor, (s((1, 1, 6, n)), x)),
                  (aten.add.Tensor, (x, s(tuple(x.tensor_meta.shape)))), (aten.div.Scalar, (x, 3)),
                  (aten.mul.Tensor, (x, s((2, 4, 6, 1)))), (aten.mul.Tensor, (x, s((), dtype=torch.float32)))]
    cases += [(aten.add.Tensor, (back, q)), (aten.mul.Tensor, (t, s((4, 8, 6), (1, 4, 32)))),
              (aten.add.Tensor, (s((2, 4, 6, 8)), q)), (aten.add.Tensor, (q, s((2, 4, 6, 8)))),
              (aten.add.Tensor, (q, s((2, 4, 1, 8)))), (aten.add.Tensor, (q, s((2, 4, 6, 8), (192, 1, 32, 4)))),
              (aten.add.Tensor, (q, back)), (aten.div.Scalar, (s((4, 6, 8), (6, 1, 0)), 8)), (aten.neg.default, (s((4, 1, 8), (8, 64, 1)),))]
    odd = s((4, 1, 8), (8, 64, 1))  # contiguous, with an unusual stride on its size-1 dim
    cases += [(aten.add.Tensor, (odd, odd)), (aten.add.Tensor, (odd, s((4, 1, 8)))), (aten.mul.Tensor, (odd, s((4, 6, 8)))),
              (aten.mul.Tensor, (s((4, 6, 8), (1, 4, 24)), s((4, 6, 8), (1, 4, 24)))), (aten.exp.default, (s((4, 6, 8), (1, 4, 24)),)),
              (aten.mul.Tensor, (s((4, 6, 8), (1, 4, 24)), s((6, 8))))]
    cases += [(aten.mm.default, (s((6, 8)), s((8, 5)))), (aten.mm.default, (s((6, 8)), s((8, 5), (1, 8)))),
              (aten.bmm.default, (s((3, 6, 8)), s((3, 8, 5)))), (aten.t.default, (s((6, 8)),)), (aten.t.default, (s((6,)),)),
              (aten.transpose.int, (s((4, 6, 8)), 1, 2)), (aten.transpose.int, (t, -1, 0))]
    for dim in (0, 1, -1):
        cases += [(aten._log_softmax.default, (s((6, 8)), dim, False)), (aten._softmax.default, (s((4, 6, 8)), dim, False)),
                  (aten._softmax_backward_data.default, (s((6, 8)), s((6, 8)), dim, torch.float32)),
                  (aten._log_softmax_backward_data.default, (s((6, 8)), s((6, 8)), dim, torch.float32))]
    target = s((6,), dtype=torch.int64)
    for reduction in (0, 1, 2):
        cases += [(aten.nll_loss_forward.default, (s((6, 8)), target, None, reduction, -100))]
    cases += [(aten.nll_loss_backward.default, (s(()), s((6, 8)), target, None, 1, -100, s(())))]
    for shape in [(4, 6, 8), (4, 1, 8), (1, 48)]:
        n = int(torch.Size(shape).numel())
        for new in [(n,), (-1, 8), (2, -1, 1, 4), (1, n), (n, 1), (2, 2, -1)]:
            cases += [(aten.view.default, (s(shape), list(new))), (aten._unsafe_view.default, (s(shape), list(new)))]
    for args in [(1,), (1, 2), (1, 2, 5), (2, 0, 16, 2), (2, -3, None), (2, None, -1, 3), (0, 5, 9), (-1, -20, 3), (1, 4, 2)]:
        cases += [(aten.slice.Tensor, (s((4, 6, 8)), *args)), (aten.slice.Tensor, (t, *args))]
    for args in [(4,), (4, -1), (3, 2), (5, 0), (8, 1), (2, -3)]:
        cases += [(aten.split.Tensor, (s((6, 8, 5)), *args)), (aten.split.Tensor, (t, *args))]
    for shape, new in [((4, 1, 8), [4, 6, 8]), ((1, 8), [3, 5, 8]), ((4, 1, 8), [-1, 6, -1]), ((8,), [2, 8])]:
        cases += [(aten.expand.default, (s(shape), new))]
    # reductions (RMSNorm's mean, the router's sums) over kept and dropped dims, size-1 dims included
    for shape in [(4, 6, 8), (4, 1, 8), (1, 6, 1), (8,), ()]:
        for dims, keep in itertools.product([None, [], [-1], [0], [0, 1], [1, -1]], [False, True]):
            if dims and any(d >= max(len(shape), 1) for d in dims):
                continue
            cases += [(aten.sum.dim_IntList, (s(shape), dims, keep)), (aten.mean.dim, (s(shape), dims, keep))]
    cases += [(aten.sum.dim_IntList, (t, [1], True)), (aten.mean.dim, (t, [-1]))]  # transposed: the meta kernel
    cases += [(aten.floor_divide.default, (s((6,), dtype=torch.int64), 2)), (aten.floor_divide.default, (s((4, 6)), s((6,))))]
    # row-major non-contiguous operands: a column slice (the experts' gate half), an expanded mean grad
    col, wide = s((6, 4), (8, 1)), s((4, 6, 8), (6, 1, 0))
    cases += [(aten.silu.default, (col,)), (aten.mul.Tensor, (s((6, 4)), col)), (aten.silu_backward.default, (s((6, 4)), col)),
              (aten.div.Scalar, (wide, 8)), (aten.mul.Tensor, (wide, s((4, 6, 8))))]
    for x in (s((4, 6, 8)), t, s((4, 1, 8)), s(())):
        cases += [(aten.unsqueeze.default, (x, d)) for d in range(-len(x.tensor_meta.shape) - 1, len(x.tensor_meta.shape) + 1)]
    for op in (aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default):
        cases += [(op, (t, [3, 5])), (op, (s((4, 6, 8)), [4, 1, 8])), (op, (s((2,)), []))]
    cases += [(aten.new_full.default, (t, [3, 5], 2.0)), (aten.slice_backward.default, (s((4, 6, 4)), [4, 6, 8], 2, 4, 8, 1)),
              (aten.slice_backward.default, (t, [4, 16, 6], 1, 0, 16, 2))]
    # the router's and the MoE dispatch's fresh allocations, transposed and size-1 layouts included
    idx = lambda *shape, dtype=torch.int64: s(shape, dtype=dtype)  # noqa: E731
    for x in (s((6, 8)), t, s((6, 1)), s((1, 8)), s((4, 6, 8)), s((8,))):
        n = x.tensor_meta.shape
        cases += [(aten.topk.default, (x, 1)), (aten.topk.default, (x, min(2, n[0]), 0)), (aten.sort.default, (x,)),
                  (aten.empty_like.default, (x,)), (aten.index.Tensor, (x, [idx(5)])), (aten.index.Tensor, (x, [idx(2, 3)])),
                  (aten.index.Tensor, (x, [idx(4, dtype=torch.int32)])), (aten.index.Tensor, (x, [idx(0)])),
                  (aten.index_put.default, (x, [idx(3)], s((3, *n[1:])), True))]
    cl = s((2, 4, 3, 3), (36, 1, 12, 4))  # channels-last
    for xs, dim in [((q, back), -1), ((half, half), -1), ((q, q), 1),
                    ((s((6, 8)), t.__class__(mesh, t.placements, tensor_meta=TensorMeta(torch.Size((6, 8)), (1, 6), torch.float32))), 0),
                    ((cl, cl), 1), ((cl, s((2, 4, 3, 3))), 0), ((s((2, 4, 3, 3)), cl), 0), ((s((4, 1, 8)), s((4, 3, 8))), 1), ((s((5,)), s((0,))), 0)]:
        cases += [(aten.cat.default, (list(xs), dim))]
    cases += [(aten.histc.default, (s((8,)), 16, 0, 15)), (aten.histc.default, (s((4, 6)), 5)),
              (aten.embedding_dense_backward.default, (s((2, 5, 8)), idx(2, 5), 12, -1, False)),
              (aten.embedding_dense_backward.default, (s((2, 5, 8), (8, 16, 1)), idx(2, 5), 3, 0, False))]
    # the MoE step's remaining meta kernels: router in-place ops, the loss's label shift, expert kernels
    for x in (s((4, 6, 8)), t, s((4, 1, 8)), s((6, 1)), s((6, 1), (1, 1)), s(())):
        n = tuple(x.tensor_meta.shape)
        cases += [(aten.div_.Tensor, (x, s(n))), (aten.mul_.Tensor, (x, 2.0)), (aten.add_.Tensor, (x, s(n[-1:])))]
        cases += [(aten.squeeze.dim, (x, d)) for d in range(-len(n), len(n))]
        cases += [(aten._to_copy.default, (x,)), (aten.view.default, (x, list(n)))]
    cases += [(aten.index_put_.default, (s((6, 8)), [idx(3)], s((3, 8)), True)), (aten.index_put_.default, (t, [idx(2)], s((2, 6)))),
              (aten.scatter.src, (s((6, 8)), -1, idx(6, 2), s((6, 2)))), (aten.scatter.src, (t, 0, idx(2, 8, 6), s((2, 8, 6)))),
              (aten.scatter.value, (s((6, 8)), 1, idx(6, 2), 1.0))]
    for x, pad in [(idx(2, 7), [0, 1]), (s((4, 6, 8)), [1, 2, 0, 3]), (s((4, 6, 8)), [-1, 2]), (t, [0, 1]), (cl, [1, 1]),
                   (s((6,)), [2, 2]), (s((4, 6)), [1, 1, 1, 1])]:
        cases += [(aten.constant_pad_nd.default, (x, pad, -100.0))]
    cases += [(aten.embedding.default, (s((16, 4)), idx(2, 6))), (aten.embedding.default, (s((16, 4), (1, 16)), idx(7, dtype=torch.int32)))]
    offs, bf = idx(4, dtype=torch.int32), torch.bfloat16  # the meta kernel takes bf16 only (datadep: fp32)
    cases += [(aten._grouped_mm.default, (s((10, 8), dtype=bf), s((4, 8, 16), dtype=bf), offs)),
              (aten._grouped_mm.default, (s((10, 8), dtype=bf), s((4, 8, 16), (128, 1, 8), dtype=bf), offs)),
              (aten._grouped_mm.default, (s((8, 16), (1, 8), dtype=bf), s((16, 24), dtype=bf), offs)),
              (aten._grouped_mm.default, (s((4, 10, 8), dtype=bf), s((4, 8, 16), dtype=bf)))]
    return cases


def test_arithmetic_output_metadata_equals_fake_tensor_propagation(mesh):
    prop = DTensor._op_dispatcher.sharding_propagator
    known = 0
    for op, args in _meta_cases(mesh):
        schema = OpSchema(op, args, {})
        theirs = type(prop)._propagate_tensor_meta_non_cached(prop, schema)  # PyTorch's FakeTensor run
        dtypes = theirs.dtype if isinstance(theirs, TensorMeta) else tuple(m.dtype for m in theirs)
        ours = fast_outputs(schema, dtypes)
        if ours is None:
            continue
        known += 1
        outs, refs = ((ours,), (theirs,)) if isinstance(ours, TensorMeta) else (ours, theirs)
        for a, b in zip(outs, refs):
            assert (tuple(a.shape), tuple(a.stride), a.dtype) == (tuple(b.shape), tuple(b.stride), b.dtype), f"{op} {args}"
    assert known >= 100, f"only {known} cases took the arithmetic path"
    x = _spec(mesh, (4, 6, 8), (48, 1, 6))
    for op in (aten.add_.Tensor, aten.mul_.Tensor):  # the result is the argument, laid out as it is
        ours = fast_outputs(OpSchema(op, (x, x), {}), torch.float32)
        assert (tuple(ours.shape), tuple(ours.stride)) == ((4, 6, 8), (48, 1, 6))
    assert fast_outputs(OpSchema(aten.add_.Tensor, (x, x), {}), torch.float64) is None  # self's dtype or nothing


def test_a_clone_to_contiguous_format_is_contiguous_whatever_the_layout(mesh):
    prop = DTensor._op_dispatcher.sharding_propagator
    for shape, stride in [((4, 8, 6), (48, 1, 8)), ((4, 6, 8), (6, 1, 0)), ((4, 1, 8), (8, 64, 1))]:
        for fmt in (torch.contiguous_format, torch.preserve_format):
            schema = OpSchema(aten.clone.default, (_spec(mesh, shape, stride),), {"memory_format": fmt})
            theirs = type(prop)._propagate_tensor_meta_non_cached(prop, schema)
            ours = fast_outputs(schema, theirs.dtype)
            if fmt is torch.contiguous_format:
                assert ours is not None and tuple(ours.stride) == tuple(theirs.stride), f"{shape} {stride}"
            else:
                assert ours is None


@pytest.mark.parametrize("shape,new", list(itertools.product([(4, 6, 8), (4, 1, 8), (1, 6, 1, 8)], [(-1,), (2, -1), (-1, 1, 4)])))
def test_a_view_of_a_contiguous_tensor_is_contiguous(shape, new):
    """What ``metas._view`` assumes, checked on PyTorch's own view kernel (size-1 dims included)."""
    y = torch.empty(shape, device="meta").view(new)
    assert y.is_contiguous() and y.stride() == torch.empty(y.shape).stride()


def test_elementwise_metadata_equals_fake_tensor_on_random_layouts(mesh):
    """Seeded random layouts (permuted, sliced, size-1 and broadcast dims) of unary, binary and
    ternary elementwise ops: the arithmetic answer equals PyTorch's FakeTensor run every time it
    answers at all (size-1 output dims, where PyTorch's own paths may disagree, only for inputs of the
    output's shape, all canonical contiguous)."""
    import random

    prop = DTensor._op_dispatcher.sharding_propagator
    rng = random.Random(0)

    def layout(shape, dtype=torch.float32):
        base = torch.empty([n * rng.choice((1, 1, 2)) for n in shape], device="meta")
        x = base[tuple(slice(None, n) for n in shape)]
        perm = list(range(len(shape)))
        rng.shuffle(perm)
        x = x.permute(perm).contiguous().permute([perm.index(i) for i in range(len(shape))]) if rng.random() < 0.5 else x
        return _spec(mesh, tuple(x.shape), tuple(x.stride()), dtype)

    answered = 0
    for _ in range(600):
        shape = tuple(rng.choice((1, 2, 3, 5)) for _ in range(rng.randint(1, 4)))
        other = tuple(n if rng.random() < 0.7 else 1 for n in shape)[rng.randint(0, len(shape) - 1):]
        op, args = rng.choice([(aten.neg.default, (layout(shape),)), (aten.add.Tensor, (layout(shape), layout(other))),
                               (aten.mul.Tensor, (layout(other), layout(shape))), (aten.add.Tensor, (layout(shape), layout(shape))),
                               (aten.mul.Tensor, (layout(shape), _spec(mesh, ()))),
                               (aten.where.self, (layout(other, torch.bool), layout(shape), layout(shape)))])
        schema = OpSchema(op, args, {})
        theirs = type(prop)._propagate_tensor_meta_non_cached(prop, schema)
        ours = fast_outputs(schema, theirs.dtype)
        if ours is not None:
            answered += 1
            assert (tuple(ours.shape), tuple(ours.stride)) == (tuple(theirs.shape), tuple(theirs.stride)), f"{op} {args}"
    assert answered >= 150, f"only {answered} of 600 answered"


def test_a_replayed_spec_is_what_dtensorspecs_constructor_makes(mesh):
    """Hits copy a constructor-made template's fields instead of constructing (the shard order is
    derived from the placements alone); the copy must equal a constructed spec field for field."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.placement_types import _StridedShard

    from vescale.dispatch.fast.cache import _with_metas

    learned = TensorMeta(torch.Size([8, 6, 4]), (24, 4, 1), torch.float32)
    now = TensorMeta(torch.Size([8, 10, 4]), (40, 4, 1), torch.float32)
    for placements in [(Shard(0), Shard(1)), (Replicate(), Partial()), (Shard(0), _StridedShard(0, split_factor=2)), (Shard(1), Shard(1))]:
        template = _with_metas(DTensorSpec(mesh, placements, tensor_meta=learned), learned, mesh)
        copied = _with_metas(template, now, mesh, built=True)
        built = DTensorSpec(mesh, placements, tensor_meta=now, use_strided_shard_as_shard_order=template.use_strided_shard_as_shard_order)
        assert {k: v for k, v in vars(copied).items() if k != "_hash"} == {k: v for k, v in vars(built).items() if k != "_hash"}
        assert copied == built and hash(copied) == hash(built) and copied.mesh is mesh


def test_miss_path_metadata_for_mm_and_embedding_equals_fake_tensor_propagation(mesh):
    """A miss of a new length skips the FakeTensor run for mm and embedding (metas.miss_outputs);
    every answer must be PyTorch's, and mixed dtypes are left to PyTorch (which refuses them)."""
    prop = DTensor._op_dispatcher.sharding_propagator
    s = lambda *a, **k: _spec(mesh, *a, **k)  # noqa: E731
    ids = lambda shape, dtype=torch.int64: s(shape, dtype=dtype)  # noqa: E731
    cases = [(aten.mm.default, (s((6, 8)), s((8, 5)))), (aten.mm.default, (s((6, 8), (1, 6)), s((8, 5), (1, 8)))),
             (aten.bmm.default, (s((3, 6, 8)), s((3, 8, 5)))), (aten.mm.default, (s((6, 8), dtype=torch.bfloat16), s((8, 5), dtype=torch.bfloat16))),
             (aten.embedding.default, (s((16, 4)), ids((2, 6)))), (aten.embedding.default, (s((16, 4)), ids((7,), torch.int32))),
             (aten.embedding.default, (s((16, 4), (1, 16)), ids((2, 3, 5)))), (aten.embedding.default, (s((16, 4), dtype=torch.bfloat16), ids((2, 6))))]
    for op, args in cases:
        schema = OpSchema(op, args, {})
        ours, theirs = miss_outputs(schema), type(prop)._propagate_tensor_meta_non_cached(prop, schema)
        assert ours is not None, f"{op} {args}"
        assert (tuple(ours.shape), tuple(ours.stride), ours.dtype) == (tuple(theirs.shape), tuple(theirs.stride), theirs.dtype)
    assert miss_outputs(OpSchema(aten.mm.default, (s((6, 8)), s((8, 5), dtype=torch.float64)), {})) is None


def test_a_scalar_of_another_type_is_another_key(mesh):
    """Hits take the output dtype from the learned answer; ``x ** 2`` and ``x ** 2.0`` on an integer
    tensor (``pow.Tensor_Scalar``; 2 == 2.0 as Python values) give different dtypes, so they must
    not share a key."""
    x = lambda n: _dt(mesh, (n, 8), (Shard(0), Replicate()), n, dtype=torch.int64)  # noqa: E731
    forget_dtensor_caches()
    assert (x(6) ** 2).dtype == torch.int64
    _clear_sharding_prop_cache()
    ours = x(10) ** 2.0
    dispatch.uninstall(keep_coverage=True)
    forget_dtensor_caches()
    try:
        theirs = x(10) ** 2.0
    finally:
        dispatch.install()
    assert ours._spec.tensor_meta.dtype == theirs._spec.tensor_meta.dtype == torch.float32
    _same(ours, theirs)


# --- size arguments the rule does not read (new_zeros & co., slice_backward) ----------------------


def _new_zeros(mesh, n, same):
    x = _dt(mesh, (4, n, 8), (Shard(0), Shard(1)), n)
    return x.new_zeros((4, n, 8) if same else (n, 3))


@pytest.mark.parametrize("same", [True, False])
def test_new_zeros_is_a_hit_at_a_new_length_with_pytorchs_answer(mesh, same):
    """new_factory_strategy: a sharded input's placements when the size is the input's shape (the
    size argument then made local), else Replicate; either way a hit at a new length."""
    ours, hits, misses, theirs = _learn_then_reuse(mesh, lambda n: _new_zeros(mesh, n, same), 6, 10)
    assert (hits, misses) == (1, 0)
    assert ours.placements == ((Shard(0), Shard(1)) if same else (Replicate(), Replicate()))
    _same(ours, theirs)


def test_new_zeros_of_another_shape_is_not_served_the_same_shape_decision(mesh):
    """Whether the size equals the input's shape decides the placements, so it is in the key: the
    same input asking for another shape must not follow the input."""
    x = _dt(mesh, (4, 6, 8), (Shard(0), Shard(1)))
    s = lambda size: OpSchema(aten.new_zeros.default, (x._spec, size), {})  # noqa: E731
    assert _key(s([4, 6, 8])) != _key(s([4, 7, 8]))
    assert _key(s([4, 7, 8])) == _key(s([4, 9, 8]))  # both another shape: Replicate either way
    forget_dtensor_caches()
    assert x.new_zeros((4, 6, 8)).placements == (Shard(0), Shard(1))
    _clear_sharding_prop_cache()
    ours = x.new_zeros((4, 7, 8))
    dispatch.uninstall(keep_coverage=True)
    forget_dtensor_caches()
    try:
        theirs = x.new_zeros((4, 7, 8))
    finally:
        dispatch.install()
    assert ours.placements == (Replicate(), Replicate())
    _same(ours, theirs)


def _slice_grad(mesh, n, dim):
    """The gradient of a slice (rotary's halves; a causal shift ``x[:, 1:]``, whose bounds move with
    the length): slice_backward of a sharded gradient."""
    start, end = (2, 6) if dim == 2 else (1, n)
    g = _dt(mesh, (4, n, 4) if dim == 2 else (4, n - 1, 8), (Shard(0), Shard(1)), n)
    return aten.slice_backward(g, [4, n, 8], dim, start, end, 1)


@pytest.mark.parametrize("dim", [2, 1])
def test_slice_backward_is_a_hit_at_a_new_length_with_pytorchs_answer(mesh, dim):
    """slice_backward_rules: the gradient's placements, the sliced dim replicated (dim 1, the
    sequence: the sharded dim gathered first); input_sizes, start and end are not read."""
    ours, hits, misses, theirs = _learn_then_reuse(mesh, lambda n: _slice_grad(mesh, n, dim), 6, 10)
    assert (hits, misses) == (1, 0)
    assert ours.placements == ((Shard(0), Shard(1)) if dim == 2 else (Shard(0), Replicate()))
    _same(ours, theirs)


def test_size_arguments_stay_in_the_key_when_the_rule_is_not_pytorchs(mesh):
    """Only PyTorch's own rule is known to ignore the sizes: any other rule keys them as they are."""
    import types

    g = _dt(mesh, (4, 6, 4), (Shard(0), Shard(1)))
    s = lambda n, end: OpSchema(aten.slice_backward.default, (g._spec, [4, n, 8], 2, 2, end, 1), {})  # noqa: E731
    assert _key(s(6, 6)) == _key(s(10, 9))
    other = types.SimpleNamespace(op_strategy_funcs={})
    assert _key(s(6, 6), other) != _key(s(10, 9), other)


def test_a_whole_dim_slice_is_not_replayed_on_a_longer_dim(mesh):
    """``slice(x, 1, 0, 8)`` of a sequence-sharded ``x`` keeps the shards at length 8 (the whole dim)
    and must gather at 16: the key keeps whether the slice is the whole dim. (It served the length-8
    decision at 16: ``Shard(1)`` on 8 local columns, a global tensor twice as long as the slice.)"""
    forget_dtensor_caches()
    for n, want, local in ((8, Shard(1), 4), (16, Replicate(), 8)):
        y = aten.slice.Tensor(_dt(mesh, (4, n, 4), (Shard(0), Shard(1)), n), 1, 0, 8)
        assert y.placements == (Shard(0), want) and y.to_local().shape == (2, local, 4) and y.shape == (4, 8, 4)


def test_an_adjusted_op_that_rewrites_nothing_is_a_plain_decision(mesh):
    """Ops with an argument adjuster (split's sizes, slice's bounds: ``vescale.dispatch.fast.interleaved``)
    that leave every argument as it was (a tensor not interleaved where it is cut) need no
    redistribution: DTensor's C++ path runs them (PyTorch marks every such call as rewritten once
    an input is sharded, which costs its Python slow path, 2-3x a slice's cost on the CPU)."""
    forget_dtensor_caches()
    prop = DTensor._op_dispatcher.sharding_propagator
    x = _dt(mesh, (4, 6, 16), (Shard(0), Shard(1)))
    for op, args in ((aten.slice.Tensor, (2, 0, 8)), (aten.split.Tensor, (8, 2))):
        decision = prop.propagate_op_sharding_non_cached(OpSchema(op, (x._spec, *args), {}))  # what DTensor asks on a miss
        assert not decision.needs_redistribute and decision.redistribute_schema is None, (op, decision)


# --- misses that stay PyTorch's decisions take checked metadata, not a FakeTensor run -------------


def _partial_plus_shard(mesh, n):
    """A Partial gradient meeting a token-sharded one (the MoE router's backward): PyTorch's cost
    search reduce-scatters the Partial operand, a decision the cache leaves to PyTorch."""
    from torch.distributed.tensor import Partial

    a = DTensor.from_local(torch.randn(n, 8, generator=torch.Generator().manual_seed(n)), mesh,
                           (Replicate(), Partial()), run_check=False)
    return a + _dt(mesh, (n, 8), (Replicate(), Shard(0)), n)


def test_a_searched_miss_runs_no_fake_tensor_at_a_new_length_and_gives_pytorchs_answer(mesh, monkeypatch):
    prop = DTensor._op_dispatcher.sharding_propagator
    step = prop._propagate_tensor_meta_non_cached  # the fast path's (cache._FastOutputMetadata), over datadep's and PyTorch's
    fake_runs = []
    real = step.fallback
    monkeypatch.setattr(step, "fallback", lambda schema: fake_runs.append(schema.op) or real(schema))
    forget_dtensor_caches()
    _partial_plus_shard(mesh, 8)
    assert fake_runs == []  # the first miss: add's Meta kernel, the one FakeTensor would run (metas.kernel_outputs)
    _clear_sharding_prop_cache()
    ours = _partial_plus_shard(mesh, 12)
    assert fake_runs == [], "a miss at a new length ran FakeTensor"
    dispatch.uninstall(keep_coverage=True)
    forget_dtensor_caches()
    try:
        theirs = _partial_plus_shard(mesh, 12)
    finally:
        dispatch.install()
    _same(ours, theirs)


def test_metadata_that_differs_from_pytorchs_is_not_vouched_for(mesh):
    cache = dispatch.shape_free_cache()
    x = _spec(mesh, (4, 6, 8))
    schema = OpSchema(aten.add.Tensor, (x, x), {})
    right = TensorMeta(torch.Size((4, 6, 8)), (48, 8, 1), torch.float32)
    wrong = TensorMeta(torch.Size((4, 6, 8)), (1, 4, 24), torch.float32)
    assert cache._known_metas(schema, right, torch.float32) == torch.float32
    assert cache._known_metas(schema, wrong, torch.float32) is None
