"""Cost-searched decisions reused at a new length: ``_grouped_mm`` with its stride rule in the key
(``interleaved.grouped_mm_layout_key``) and zero-cost moves of replicated inputs
(``vescale.dispatch.fast.zerocost``: mm, bmm, index_put, scatter, elementwise ops).

Each case is learned at one length and run at another with PyTorch's shape-keyed caches cleared:
the shape-free cache answers (one hit, no miss), and the result equals PyTorch's own (placements,
shapes, strides, rank 0's local values). Where a size changes what PyTorch's rule could choose (a
dim too small for the mesh's shard counts, a local stride off the kernel's 16-byte rule, operands
that no longer agree in size on a scatter axis), the key or the entry's guard differs and PyTorch
decides.
"""

from __future__ import annotations

import pytest
import torch
import torch.testing._internal.distributed.fake_pg  # noqa: F401
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema

from vescale import dispatch
from vescale.dispatch.fast import zerocost
from vescale.dispatch.fast.cache import _key, _same_decision, install_shape_free_cache, uninstall_shape_free_cache
from vescale.testing import forget_dtensor_caches
from vescale.placement import InterleavedShard

from test_shape_free import _dt, _learn_then_reuse, _same

aten = torch.ops.aten
R, P = Replicate(), Partial()


def _offs(m, n):
    return DTensor.from_local(torch.arange(1, 5, dtype=torch.int32) * n, m, (R, R), run_check=False)


def _experts_up(m, n):  # tokens times a column-split expert weight: Shard(1) out, nothing moves
    return torch._grouped_mm(_dt(m, (4 * n, 16), (R, R), n), _dt(m, (4, 16, 8), (R, Shard(2)), 1), offs=_offs(m, n))


def _experts_down(m, n):  # column-split activations times a row-split weight: a Partial sum
    return torch._grouped_mm(_dt(m, (4 * n, 8), (R, Shard(1)), n), _dt(m, (4, 8, 16), (R, Shard(1)), 1), offs=_offs(m, n))


def _experts_weight_grad(m, n):  # tokens^T times a column-split gradient: (groups, 16, 8), Shard(2)
    x = _dt(m, (4 * n, 16), (R, R), n).t()
    return torch._grouped_mm(x, _dt(m, (4 * n, 8), (R, Shard(1)), 2), offs=_offs(m, n))


def _index_put_partial(m, n):  # the MoE combine's backward: a Partial gradient into replicated zeros
    zeros = DTensor.from_local(torch.zeros(n, 8), m, (R, R), run_check=False)
    idx = DTensor.from_local(torch.arange(n - 1, -1, -1), m, (R, R), run_check=False)
    return torch.index_put(zeros, (idx,), _dt(m, (n, 8), (R, P), n))


def _scatter_partial(m, n):  # the router's top-k backward (partial.py's Partial strategy)
    zeros = DTensor.from_local(torch.zeros(n, 16), m, (R, R), run_check=False)
    idx = DTensor.from_local(torch.arange(2 * n).reshape(n, 2) % 16, m, (R, R), run_check=False)
    return zeros.scatter(-1, idx, _dt(m, (n, 2), (R, P), n))


def _partial_plus_replicate(m, n):  # a residual add in the router's backward
    return _dt(m, (n, 8), (R, P), n) + _dt(m, (n, 8), (R, R), n + 1)


def _partial_times_replicate(m, n):
    return _dt(m, (n, 8), (R, P), n) * _dt(m, (n, 8), (R, R), n + 1)


def _mm_weight_grad(m, n):  # a linear's weight gradient under DP x TP: the replicated operand's columns sliced
    return _dt(m, (n, 16), (Shard(0), R), n) @ _dt(m, (16, 8), (R, Shard(0)), 1)


def _bmm_both_moved(m, n):  # each operand's replicated placement sliced, one per mesh dim
    return torch.bmm(_dt(m, (4, n, 16), (Shard(0), R), n), _dt(m, (4, 16, 8), (R, Shard(1)), 1))


CASES = {"mm weight grad": _mm_weight_grad, "bmm": _bmm_both_moved, "grouped_mm up": _experts_up, "grouped_mm down": _experts_down,
         "grouped_mm weight grad": _experts_weight_grad,
         "index_put of a Partial": _index_put_partial, "scatter of a Partial": _scatter_partial,
         "Partial + Replicate": _partial_plus_replicate, "Partial * Replicate": _partial_times_replicate}


@pytest.mark.parametrize("case", CASES)
def test_a_searched_decision_learned_at_one_length_is_a_hit_at_another_with_pytorchs_answer(mesh, case):
    ours, hits, misses, theirs = _learn_then_reuse(mesh, lambda n: CASES[case](mesh, n), 8, 12)
    assert misses == 0 and hits >= 1, f"{case}: {hits} hits, {misses} misses at a new length"
    if case != "scatter of a Partial":  # a strategy of vescale's own (partial.py): PyTorch reduce-scatters
        _same(ours, theirs)
    else:
        _same(ours, _without_shape_free_cache(lambda: CASES[case](mesh, 12)))


def _without_shape_free_cache(fn):
    """fn() decided by the propagator with vescale's rules but without the shape-free cache."""
    forget_dtensor_caches()
    uninstall_shape_free_cache()
    try:
        return fn()
    finally:
        install_shape_free_cache()
        forget_dtensor_caches()


def test_a_free_move_is_not_reused_where_a_dim_no_longer_fits_the_mesh(mesh):
    """Learned with 8 rows (room for 2 and 4 shards), asked with 3 (room for 2 only): PyTorch's
    rule could rank its candidates differently, so PyTorch decides."""
    for case in ("index_put of a Partial", "Partial + Replicate"):
        ours, hits, misses, theirs = _learn_then_reuse(mesh, lambda n: CASES[case](mesh, n), 8, 3)
        assert misses >= 1, case
        _same(ours, theirs)


def test_a_move_of_a_partial_input_is_not_free(mesh):
    """Partial + Shard: the search reduce-scatters or all-reduces the Partial operand, a cost that
    depends on sizes; the decision stays PyTorch's at every length."""
    def fn(n):
        return DTensor.from_local(torch.ones(n, 8), mesh, (R, P), run_check=False) + _dt(mesh, (n, 8), (Shard(0), Shard(0)), n)

    ours, hits, misses, theirs = _learn_then_reuse(mesh, fn, 8, 12)
    assert misses == 1 and hits == 0
    _same(ours, theirs)


def _meta(*shape, dtype=torch.float32):
    return TensorMeta(torch.Size(shape), torch.empty(shape, device="meta").stride(), dtype)


def _grouped_schema(mesh, weight_placements, hidden):
    a = DTensorSpec(mesh, (R, Shard(1)), tensor_meta=_meta(10, 8))
    b = DTensorSpec(mesh, weight_placements, tensor_meta=_meta(4, 8, hidden))
    offs = DTensorSpec(mesh, (R, R), tensor_meta=_meta(4, dtype=torch.int32))
    return OpSchema(aten._grouped_mm.default, (a, b, offs), {})


@pytest.mark.parametrize("weight", [(R, Shard(2)), (R, InterleavedShard(2, 2))], ids=["Shard", "InterleavedShard"])
def test_grouped_mm_keys_hold_the_local_stride_rule(mesh, weight):
    """A weight whose local rows stop being a multiple of 16 bytes (12 columns split in 2: 24
    bytes) makes another key than 16 (or 32) columns, where the key's sizes alone would not tell
    them apart; each answer is the one vescale's rules and PyTorch's search give for it."""
    cache = dispatch.shape_free_cache()
    keys = {h: _key(_grouped_schema(mesh, weight, h)) for h in (16, 32, 12)}
    assert keys[16] != keys[12]
    if weight[1] == Shard(2):  # an interleaved dim's key keeps its exact size anyway
        assert keys[16] == keys[32]
    for h in (16, 32, 12):
        schema = _grouped_schema(mesh, weight, h)
        assert _same_decision(cache(schema), cache.fallback(schema))


def test_scatter_keys_hold_the_axes_its_rule_may_shard(mesh):
    """scatter_strategy offers to shard an axis only where self, index and src agree in size."""
    def schema(rows_src):
        s = lambda *shape: DTensorSpec(mesh, (R, R), tensor_meta=_meta(*shape))  # noqa: E731
        index = DTensorSpec(mesh, (R, R), tensor_meta=_meta(8, 2, dtype=torch.int64))
        return OpSchema(aten.scatter.src, (s(8, 16), -1, index, s(rows_src, 2)), {})

    assert zerocost.scatter_axes(schema(8)) == (0,) and zerocost.scatter_axes(schema(9)) == ()
    assert _key(schema(8)) != _key(schema(9))


def test_room_counts_the_mesh_shard_counts_each_dim_fits(mesh):
    s = lambda *shape: DTensorSpec(mesh, (R, R), tensor_meta=_meta(*shape))  # noqa: E731
    assert zerocost.room(OpSchema(aten.add.Tensor, (s(8, 1, 3), s(2, 4, 0)), {})) == ((2, 0, 1), (1, 2, 0))


def _ids_and_weight_specs(mesh, n, vocab=32):
    ids = DTensorSpec(mesh, (Shard(0), R), tensor_meta=_meta(4, n, dtype=torch.int64))
    weight = DTensorSpec(mesh, (R, Shard(0)), tensor_meta=_meta(vocab, 8))
    return OpSchema(aten.embedding.default, (weight, ids), {})


def test_the_vocabulary_parallel_embedding_is_reused_with_its_masked_partial(mesh):
    """Indices masked on the vocabulary dim (Replicate -> _MaskPartial, free): at a new length the
    decision is the learned one, the output and the indices' target sharing one mask buffer (as
    PyTorch's own cache shares it at a repeated shape), equal to PyTorch's but for that buffer;
    another vocabulary size is another key (the masked Partial carries the weight's shape)."""
    from torch.distributed.tensor.placement_types import _MaskPartial

    cache = dispatch.shape_free_cache()
    cache(_ids_and_weight_specs(mesh, 8))
    hits = cache.hits
    ours = cache(_ids_and_weight_specs(mesh, 12))
    assert cache.hits == hits + 1
    theirs = cache.fallback(_ids_and_weight_specs(mesh, 12))
    (_, out), (_, target) = ours.output_spec.placements, ours.redistribute_schema.args_spec[1].placements
    assert isinstance(out, _MaskPartial) and out is target
    for a, b in [(ours.output_spec, theirs.output_spec), *zip(ours.redistribute_schema.args_spec, theirs.redistribute_schema.args_spec)]:
        assert a.tensor_meta == b.tensor_meta
        assert [(type(p), getattr(p, "offset_shape", None)) for p in a.placements] == [
            (type(p), getattr(p, "offset_shape", None)) for p in b.placements]
    assert _key(_ids_and_weight_specs(mesh, 8, vocab=64)) != _key(_ids_and_weight_specs(mesh, 8))


def test_the_vocabulary_parallel_embedding_gives_pytorchs_values_at_a_new_length(mesh):
    def fn(n):
        weight = _dt(mesh, (32, 8), (R, Shard(0)), 1)
        ids = DTensor.from_local(torch.arange(4 * n).reshape(4, n)[:2] % 32, mesh, (Shard(0), R), run_check=False,
                                 shape=(4, n), stride=(n, 1))
        return torch.nn.functional.embedding(ids, weight).redistribute(mesh, (Shard(0), R))

    ours, hits, misses, theirs = _learn_then_reuse(mesh, fn, 8, 12)
    assert hits == 1 and misses == 0
    _same(ours, theirs)
