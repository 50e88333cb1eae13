"""A reshape's sharding decision without PyTorch's view rule at every new size.

The shape-free cache keys a ``view`` / ``_unsafe_view`` / ``reshape`` by the decision PyTorch's view
rule makes at the call's sizes (``view_groups`` then ``propagate_shape_and_sharding``): which input
placements survive and where each lands in the output. That rule is exact but costs ~35 us a call
in Python, and a transformer at a new sequence length makes dozens of such calls, every one at
sizes never seen before.

The decision reads the sizes through little: how the dims group (which input dims flatten into,
or split into, which output dims) and, for the dims that are sharded, whether their sizes divide
the mesh. ``decision`` computes that summary (a few microseconds of integer arithmetic) and keeps
PyTorch's decision per summary, asking PyTorch's rule once per summary. The summary of a call:

* its strictness (``view`` / ``_unsafe_view`` raise where ``reshape`` gathers), mesh, placements,
  dtype and input rank (as the exact key has them);
* the groups: left to right, the smallest runs of input and output dims whose sizes multiply to the
  same number. When every size is at least 2 this is exactly how ``view_groups`` pairs them, and the
  rule it returns follows from the group counts alone except for the sizes inside a ``Split``;
* per plain ``Shard(d)`` on mesh dim ``m``: where ``d`` sits in its group, whether its global size
  and its size after the earlier mesh dims that shard it divide mesh dim ``m`` (the rule's evenness
  tests), and, where ``d`` is split, whether the first output size of the split divides each mesh
  dim (the rule's ``shard_allowed`` test). A sharded dim that is not first in its flatten group
  turns into a ``_StridedShard`` whose split factor is the product of the sizes before it: those
  sizes are kept exactly. Sizes in groups with no sharded dim are read by nothing but the groups.

Calls the summary does not cover are keyed by their exact sizes (still one rule call per distinct
call, then a dict hit): a size below 2 (singleton dims take ``view_groups``' backtracking branches),
a ``_StridedShard`` input (its rules read split factors and sizes), a sharded dim in a group that
both flattens and splits, symbolic sizes. ``tests/dispatch/test_view_key.py`` checks decisions
(including the strict views' errors) against PyTorch's rule on random reshapes, with the summary
table kept across cases so that two calls sharing a summary must agree.
"""

from __future__ import annotations


from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

from torch import Tensor, reshape
from vescale._torch import dim_maps
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from vescale.memo import Memo

from .viewrule import propagate_view

if TYPE_CHECKING:
    from vescale._torch import OpSchema

__all__ = ["decision", "clear_view_decisions"]

_RAISES = object()  # PyTorch's rule raises for this summary (a strict view of an uneven split)
# Summaries are small; exact-size entries (the uncovered calls) grow with every new size: bounded.
_DECISIONS = Memo("view decisions", 8192)
_GROUPED = (Tensor.view, reshape)  # their ``dim_maps`` rule is ``view_groups``


def _target_shape(numel: int, sizes) -> tuple | None:
    """The view's output sizes with a ``-1`` inferred, or None (symbolic, several -1, mismatch)."""
    sizes = tuple(sizes)
    known, missing = 1, None
    for i, s in enumerate(sizes):
        if type(s) is not int:
            return None
        if s == -1 and missing is None:
            missing = i
        elif s < 0:
            return None
        else:
            known *= s
    if missing is not None:
        if known == 0 or numel % known:
            return None
        sizes = sizes[:missing] + (numel // known,) + sizes[missing + 1:]
    elif known != numel:
        return None
    return sizes


def _groups(src: tuple, dst: tuple) -> tuple | None:
    """``(input dims, output dim count)`` per group, left to right, for sizes that are all >= 2;
    None where any size is smaller (or a size is not an int)."""
    for s in src + dst:
        if type(s) is not int or s < 2:
            return None
    groups, i, j = [], 0, 0
    while i < len(src):
        a, b, f, t = i, j, src[i], dst[j]
        i, j = i + 1, j + 1
        while f != t:  # grow the side with the smaller product: ``view_groups``' order
            if f < t:
                f, i = f * src[i], i + 1
            else:
                t, j = t * dst[j], j + 1
        groups.append((tuple(range(a, i)), j - b, b))
    return tuple(groups)


def _summary(placements, mesh_sizes, src: tuple, dst: tuple) -> tuple | None:
    """The part of the sizes PyTorch's rule reads (see module doc), or None if not covered."""
    groups = _groups(src, dst)
    if groups is None:
        return None
    where = {d: g for g in groups for d in g[0]}
    facts = []
    for m, p in enumerate(placements):
        if type(p) is not Shard:
            if isinstance(p, (Replicate, Partial)):  # the rule passes these through
                continue
            return None  # _StridedShard (not a Shard subclass), interleaved or other shards: their rules read sizes
        dims, n_out, first_out = where[p.dim]
        if len(dims) > 1 and n_out > 1:
            return None
        n, local = mesh_sizes[m], src[p.dim]
        for earlier in range(m):
            if type(placements[earlier]) is Shard and placements[earlier].dim == p.dim:
                local //= mesh_sizes[earlier]
        pos = dims.index(p.dim)
        fact = [pos, src[p.dim] % n == 0, local % n == 0]
        if pos:
            fact.append(src[dims[0]:p.dim])  # the _StridedShard split factor's sizes
        if n_out > 1:
            fact.append(tuple(dst[first_out] % k == 0 for k in mesh_sizes))
        facts.append(tuple(fact))
    return tuple((dims, n_out) for dims, n_out, _ in groups), tuple(facts)


def _pytorch_decision(op_schema, rule_fn, strict: bool, mesh_sizes):
    spec, *rest = op_schema.args_schema
    try:
        rule = dim_maps[rule_fn](spec, *rest)
        target, out = propagate_view(spec.placements, tuple(spec.shape), rule, mesh_sizes, strict)
    except Exception:
        return _RAISES
    return len(rule), tuple(target), tuple(out)


def decision(op_schema: OpSchema, rule_fn: Callable, strict: bool, mesh_sizes: Sequence[int], layout: Hashable) -> tuple:
    """PyTorch's view-rule decision for a view-like call: ``(output rank, input target placements,
    output placements)``. Raises ``ValueError`` where PyTorch's rule raises (a strict view of an
    uneven split). ``rule_fn``: the function whose ``dim_maps`` rule PyTorch uses; calls of
    ``torch.Tensor.view`` / ``torch.reshape`` (``view_groups``) are summarised, others (``expand``)
    keyed by their exact sizes. ``layout``: a hashable standing for the input's mesh and placements
    (the caller's token for them)."""
    spec, *rest = op_schema.args_schema
    src = tuple(spec.shape)
    summary = None
    if rule_fn in _GROUPED and len(rest) == 1:
        numel = 1
        for s in src:
            numel *= s
        dst = _target_shape(numel, rest[0]) if type(numel) is int else None
        summary = None if dst is None else _summary(spec.placements, mesh_sizes, src, dst)
    key = (strict, rule_fn, layout, id(spec.tensor_meta.dtype), len(src),
           (src, tuple(tuple(a) if isinstance(a, list) else a for a in rest)) if summary is None else summary)
    found = _DECISIONS.get_or_make(key, lambda: _pytorch_decision(op_schema, rule_fn, strict, mesh_sizes))
    if found is _RAISES:
        raise ValueError("PyTorch's view rule raises for this call")
    return found


def clear_view_decisions() -> None:
    _DECISIONS.clear()
