"""Where a rank's shard lies in the global tensor, by integer arithmetic, and questions about every
rank of a mesh answered from a few representative coordinates.

DTensor answers "which global indices does the shard at mesh coordinate ``c`` hold" with
``_compute_local_shape_and_global_offset`` (index tensors, ``_StridedShard`` splits materialised;
about a millisecond a call). Asking it for every coordinate of a mesh costs time in proportion to
the world size: a 1,024-rank mesh takes seconds per tensor. This module gives

* :func:`local_block`: the same (local shape, global offset) for one coordinate, with DTensor's
  exact semantics (``torch.chunk`` splits, empty trailing chunks whose offset is the dim's global
  size, ``_StridedShard``'s split into sections first), from lists of index ranges;
* :func:`representative_coords`: a handful of coordinates such that a question about the blocks of
  several layouts at one coordinate (is this block inside that one, are these blocks contiguous,
  is this member's block the i-th slice) holds at every coordinate of the mesh iff it holds at
  these. The number of coordinates does not grow with the mesh.

Why a few coordinates suffice. Placements are applied mesh dim by mesh dim (left to right). At one
mesh dim of size ``k``, a layout that splits a tensor dim chunks the index list it holds so far (of
total length ``L``) into ``k`` chunks of ``q = ceil(L / k)``. Over a run of coordinates ``c`` in
which no chunk changes size class (full, the one partial chunk, empty) and no chunk crosses a
boundary between the list's ranges, every chunk is one piece of the same range, of the same
length, starting at an offset affine in ``c``; deeper mesh dims see the same lengths for every
``c`` of the run. So for fixed deeper coordinates every block's offset is affine in ``c`` and its
size constant over the run, and a conjunction of affine (in)equalities between blocks holds on the
whole run iff it holds at the run's two ends. The ends of all runs (plus 0 and ``k - 1``) are the
representatives of that mesh dim, chosen again below each of them for the next mesh dim.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from vescale._torch import _is_shard_like, _StridedShard

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Placement

__all__ = ["local_block", "local_shape_and_offset", "dim_ranges", "representative_coords", "is_blockwise"]

Ranges = tuple[tuple[int, int], ...]  # (global start, length) pieces, in local order


def _chunk(length: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of chunk ``index`` of ``length`` positions split into ``parts`` as torch.chunk
    does (chunks of ceil(length / parts), trailing ones short or empty)."""
    q = -(-length // parts)
    lo = min(index * q, length)
    return lo, min(lo + q, length) - lo


def _take(ranges: Ranges, start: int, size: int) -> Ranges:
    """The positions ``[start, start + size)`` of a range list (one piece per range they touch;
    pieces are not merged, so the list's structure is the same for alike chunks: see
    ``_critical``)."""
    out: list[tuple[int, int]] = []
    pos = 0
    for s, n in ranges:
        lo, hi = max(start, pos), min(start + size, pos + n)
        if lo < hi:
            out.append((s + lo - pos, hi - lo))
        pos += n
    return tuple(out)


def _merged(ranges: Ranges) -> Ranges:
    """``ranges`` with pieces that continue each other joined."""
    out: list[tuple[int, int]] = []
    for s, n in ranges:
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((s, n))
    return tuple(out)


def _total(ranges: Ranges) -> int:
    return sum(n for _, n in ranges)


def _sections(p) -> int:
    return p._split_factor_int() if isinstance(p, _StridedShard) else 1


def _split(ranges: Ranges, p, k: int, c: int) -> Ranges:
    """What coordinate ``c`` of a mesh dim of size ``k`` keeps of ``ranges`` under placement ``p``:
    ``Shard`` chunks the list; ``_StridedShard(split_factor=f)`` chunks it into ``f`` sections and
    each section into ``k``, and keeps chunk ``c`` of every section, in section order."""
    length = _total(ranges)
    f = _sections(p)
    if f == 1:
        return _take(ranges, *_chunk(length, k, c))
    out: list[tuple[int, int]] = []
    for j in range(f):
        section = _take(ranges, *_chunk(length, f, j))
        out += _take(section, *_chunk(_total(section), k, c))
    return tuple(out)


def dim_ranges(size: int, dim: int, mesh_shape: Sequence[int], coord: Sequence[int], placements: Sequence[Placement]) -> Ranges:
    """The global indices along tensor dim ``dim`` (of length ``size``) that the shard at ``coord``
    holds, in local order, as merged ``(start, length)`` ranges."""
    ranges: Ranges = ((0, size),) if size else ()
    for i, p in enumerate(placements):
        if _is_shard_like(p) and p.dim == dim:
            ranges = _split(ranges, p, mesh_shape[i], coord[i])
    return _merged(ranges)


def local_block(
    shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int], placements: Sequence[Placement]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of the shard at ``coord``: DTensor's
    ``_compute_local_shape_and_global_offset``, offsets included (an empty shard's offset is the
    dim's global size; a ``_StridedShard`` shard's is its first index)."""
    sizes, offsets = list(shape), [0] * len(shape)
    for d in {p.dim for p in placements if _is_shard_like(p)}:
        ranges = dim_ranges(shape[d], d, mesh_shape, coord, placements)
        sizes[d] = _total(ranges)
        offsets[d] = ranges[0][0] if ranges else shape[d]
    return tuple(sizes), tuple(offsets)


def local_shape_and_offset(
    shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement], skip_offset: bool = False
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """DTensor's ``compute_local_shape_and_global_offset(shape, mesh, placements, skip_offset)``, same
    arguments and results (``((0,), ())`` off the mesh), by arithmetic: no index tensors, no chunk
    per rank of a ``_StridedShard`` mesh dim."""
    coord = mesh.get_coordinate()
    if coord is None:
        return (0,), ()
    sizes, offsets = local_block(tuple(shape), tuple(mesh.shape), coord, tuple(placements))
    return sizes, (() if skip_offset else offsets)


def _critical(ranges: Ranges, p, k: int) -> set[int]:
    """Coordinates of a mesh dim of size ``k`` where the chunk ``p`` keeps of ``ranges`` changes
    kind: the first chunk that is not full, and the chunks that hold a boundary between ranges
    (per section for a ``_StridedShard``). Between two of them, chunks are alike (see the module
    docstring)."""
    length = _total(ranges)
    pieces = [ranges] if _sections(p) == 1 else [_take(ranges, *_chunk(length, _sections(p), j)) for j in range(_sections(p))]
    out: set[int] = set()
    for piece in pieces:
        n = _total(piece)
        q = -(-n // k)
        if q == 0:
            continue  # every chunk empty
        out.add(n // q)  # the first chunk that is not full (k or beyond: none)
        at = 0
        for _, m in piece[:-1]:
            at += m
            out.add(at // q)  # the chunk holding this boundary
    return out


def representative_coords(shape: Sequence[int], mesh_shape: Sequence[int], layouts: Sequence[Sequence[Placement]],
                          dims: Sequence[int] | None = None,
                          fixed: Sequence[int] | None = None) -> list[tuple[int, ...]]:
    """Coordinates standing for all coordinates of the mesh (or, with ``dims``, for all values of
    those mesh dims, the others as in ``fixed``) as far as the blocks of ``layouts`` (placement
    tuples of one global ``shape``) go: a conjunction of affine equalities and inequalities between
    block offsets and sizes, and size equalities, that holds at each of these holds at every
    coordinate. Their number depends on the layouts' unevenness, not on the mesh's size."""
    ndim = len(mesh_shape)
    vary = set(range(ndim)) if dims is None else set(dims)
    base = tuple(fixed) if fixed is not None else (0,) * ndim
    return list(_walk(tuple(shape), tuple(mesh_shape), tuple(tuple(pl) for pl in layouts), frozenset(vary), base))


def _walk(shape, mesh_shape, layouts, vary, base) -> Iterator[tuple[int, ...]]:
    # state: per layout, per tensor dim it shards, the ranges held so far
    split_dims = [sorted({p.dim for p in pl if _is_shard_like(p)}) for pl in layouts]
    start = [{d: (((0, shape[d]),) if shape[d] else ()) for d in dims} for dims in split_dims]

    def go(i: int, coord: list[int], state: Any) -> Iterator[tuple[int, ...]]:
        if i == len(mesh_shape):
            yield tuple(coord)
            return
        k = mesh_shape[i]
        if i in vary and k > 1:
            values = {0, k - 1}
            for pl, held in zip(layouts, state):
                p = pl[i]
                if _is_shard_like(p):
                    for x in _critical(held[p.dim], p, k):
                        values.update(v for v in (x - 1, x, x + 1) if 0 <= v < k)
            values = sorted(values)
        else:
            values = [base[i]]
        for c in values:
            coord[i] = c
            nxt = []
            for pl, held in zip(layouts, state):
                p = pl[i]
                if _is_shard_like(p):
                    held = dict(held)
                    held[p.dim] = _split(held[p.dim], p, k, c)
                nxt.append(held)
            yield from go(i + 1, coord, nxt)

    yield from go(0, list(base), start)


@functools.lru_cache(maxsize=4096)
def is_blockwise(shape: tuple, mesh_shape: tuple, placements: tuple) -> bool:
    """Whether every rank's shard is one contiguous block of the global tensor (consecutive global
    indices along every dim, in order), decided at representative coordinates only."""
    dims = {p.dim for p in placements if _is_shard_like(p)}
    for coord in representative_coords(shape, mesh_shape, [placements]):
        for d in dims:
            if len(dim_ranges(shape[d], d, mesh_shape, coord, placements)) > 1:
                return False
    return True
