"""Which collective turns a local tensor from one DTensor layout into another, and how to pack it.

DTensor's ``redistribute`` works one mesh dimension at a time. Here a change of layout is planned as
a single collective over the (flattened) group of every mesh dimension involved:

* ``all_reduce``: every changed dimension goes Partial -> Replicate (DP / SP gradients).
* ``reduce_scatter``: Partial -> Shard on some dimension (ZeRO-3 gradients). Each rank embeds its
  local gradient into the *base block* (the region its group shares), cuts the base block into the
  target blocks of the group's members, one padded row each, and a reduce-scatter gives every member
  the sum of its own row. Blocks a rank does not hold are zeros, so a dimension that is Shard in
  the gradient and must stay Shard under another split (a weight sharded on TP and DP) is handled in
  the same collective. A dimension that is Replicate in the gradient and Shard in the parameter is
  sliced locally first and stays out of the group; one that goes Partial -> Replicate is all-reduced
  over after the reduce-scatter (``then_all_reduce``), on the scattered shard.
* ``all_gather``: Shard -> Replicate on some dimensions (ZeRO-3 gathers), the reverse: every member
  sends its block, the base block is assembled and the target block sliced from it.

With ZeRO shards nested in their TP shards (``vescale.placement.nested``: ``InterleavedShard(0, TP)``
on DP, ``Shard(0)`` on TP, every shard still one block) a ZeRO-3 collective of a TP-sharded weight
is over DP alone. Where a weight is sharded on the same tensor dimension by an outer dimension that
changes (DP) and an inner one that does not (TP) (``(Shard(0), Shard(0))``, kept where the dim does
not divide evenly), the inner one joins the group: one collective over DP x TP instead of DTensor's
two steps. A tensor dim that an unchanged mesh dim splits, and no changing one touches, is taken at
its local extent (``_fold_kept``): every member holds the same part of it, so its split need not be
a block (a fused gate|up expert weight's ``InterleavedShard`` on TP beside its ZeRO shard on DP).
Anything else (other placement types, layouts whose shards are not blocks, Partial targets) is
``None``: the caller falls back to DTensor's per-tensor ``redistribute``.

Nothing here looks at every rank of the mesh: blocks are worked out for this rank's coordinate by
arithmetic on the placements (``vescale.placement.blocks``, DTensor's exact layout), and what must
hold for every rank (the group serves every coordinate, so all ranks pick the same collective; the
members' rows are equal slices) is decided at a few representative coordinates. The member list a
collective needs is made only for uneven rows, once per plan. Plans are cached per (shape, mesh
shape, coordinate, placements): parameters of one shape share them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from vescale._torch import _is_shard_like, _StridedShard

from ..placement import blockwise, splits
from ..placement.blocks import local_block, representative_coords

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

__all__ = [
    "Transfer", "NOTHING", "reduce_plan", "gather_plan", "pack_rows", "unpack_row", "pack_gather", "unpack_gather",
]

Block = tuple[tuple[int, ...], tuple[int, ...]]  # (shape, global offset)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One collective over mesh dims ``dims`` (flattened). For all_reduce only kind and dims matter."""

    kind: str  # "all_reduce" | "reduce_scatter" | "all_gather"
    dims: tuple[int, ...]
    base: Block = ((), ())  # the region the group shares, at this rank's coordinates
    src: Block = ((), ())  # this rank's input block
    out: Block = ((), ())  # this rank's output block
    member_count: int = 0  # members of the group (the product of the sizes of ``dims``)
    row: int = 0  # padded numel of one member's row
    contributes: bool = True  # False where the input is Replicate on a group dim and coord != 0
    even: bool = False  # members' rows are the base block's dim-0 chunks, in order: no copies needed
    held: Block = ((), ())  # the input's block where it is wider than src (sliced locally first)
    then_all_reduce: tuple[int, ...] = ()  # reduce_scatter: mesh dims the output is all-reduced over next
    # (global shape, mesh shape, this rank's coordinate, the members' placements): what ``members``
    # is worked out from, only where a caller needs every member's block (uneven rows).
    where: tuple = dataclasses.field(default=(), compare=False, repr=False)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.out[0]

    @functools.cached_property
    def members(self) -> tuple[Block, ...]:
        """Per member (flattened order): its target (RS) or source (AG) block. A list as long as the
        group, made on first use: only uneven rows (``even`` False) are packed member by member."""
        shape, mesh_shape, coord, placements = self.where
        return tuple(_block(shape, mesh_shape, c, placements) for c in _member_coords(coord, mesh_shape, self.dims))

    @functools.cached_property
    def row_lengths(self) -> torch.Tensor | None:
        """Uneven rows that are still consecutive dim-0 slices of the base block, in member order
        (a plain ``Shard`` over the group of a dim that does not divide): each member's numel, so
        that rows are packed and unpacked with one masked copy (``_row_mask``) instead of one copy
        per member. None for other layouts (slices along other dims)."""
        (bs, bo) = self.base
        if not bs:
            return None
        at, lengths = bo[0], []
        for s, o in self.members:
            if s[0] == 0:
                lengths.append(0)
                continue
            if tuple(s[1:]) != tuple(bs[1:]) or tuple(o[1:]) != tuple(bo[1:]) or o[0] != at:
                return None
            at += s[0]
            lengths.append(math.prod(s))
        return torch.tensor(lengths) if at == bo[0] + bs[0] else None


NOTHING = Transfer("none", ())  # layouts already equal


def _supported(p) -> bool:
    # _StridedShard (InterleavedShard): only in layouts whose shards are blocks, see _blocks_only.
    return type(p) in (Shard, Replicate) or _is_strided(p) or (type(p) is Partial and p.reduce_op == "sum")


def _is_strided(p) -> bool:
    return isinstance(p, _StridedShard)


def _blocks_only(shape, mesh_shape, *layouts) -> bool:
    """Every rank's piece of every layout is one block (``vescale.placement.blockwise``): the block
    arithmetic here holds. A ZeRO shard nested in its TP shard is; fused q|k|v sections are not."""
    return all(blockwise(shape, mesh_shape, tuple(pl)) for pl in layouts)


def _block(shape, mesh_shape, coord, placements) -> Block:
    """(local shape, global offset) at ``coord``: DTensor's ``_compute_local_shape_and_global_offset``,
    by arithmetic (``vescale.placement.blocks``)."""
    return local_block(shape, mesh_shape, coord, placements)


def _member_coords(coord, mesh_shape, dims, index: int | None = None):
    """Coordinates of the group's members (row-major over ``dims``), others equal to ``coord``; with
    ``index``, that member's only."""
    def at(r: int) -> tuple[int, ...]:
        c = list(coord)
        for d in reversed(dims):
            c[d] = r % mesh_shape[d]
            r //= mesh_shape[d]
        return tuple(c)

    if index is not None:
        return at(index)
    return [at(r) for r in range(math.prod(mesh_shape[d] for d in dims))]


def _member_index(coord, mesh_shape, dims) -> int:
    """The row-major index of ``coord`` over ``dims`` (its place in the flattened group)."""
    r = 0
    for d in dims:
        r = r * mesh_shape[d] + coord[d]
    return r


def _inside(inner: Block, outer: Block) -> bool:
    (s, o), (bs, bo) = inner, outer
    return all(bo[i] <= o[i] and o[i] + s[i] <= bo[i] + bs[i] for i in range(len(s)))


def _grow(dims: set[int], src, dst) -> set[int]:
    """Add the unchanged dims that shard a tensor dim which a changing dim also shards (nesting)."""
    tensor_dims = {p.dim for i in dims for p in (src[i], dst[i]) if _is_shard_like(p)}
    return dims | {j for j, p in enumerate(src) if _is_shard_like(p) and p.dim in tensor_dims}


def _replicated_on(placements, dims) -> tuple:
    return tuple(Replicate() if i in dims else p for i, p in enumerate(placements))


@functools.lru_cache(maxsize=4096)
def _fits_everywhere(shape, mesh_shape, src, dst, dims) -> bool:
    """Whether group ``dims`` serves every coordinate: each member's source and target blocks lie
    inside the block the group shares (the base: ``src`` with ``dims`` replicated).

    The base is the same for all members of a group, and every coordinate is a member of its own
    group, so "for every coordinate, every member's blocks are inside its base" is "at every
    coordinate, the src and dst blocks are inside the base". Containment is a set of affine
    inequalities between offsets and sizes, so representative coordinates decide it
    (``vescale.placement.blocks``): the cost does not grow with the mesh."""
    base_pl = _replicated_on(src, dims)
    for c in representative_coords(shape, mesh_shape, (src, dst, base_pl)):
        base = _block(shape, mesh_shape, c, base_pl)
        if not (_inside(_block(shape, mesh_shape, c, src), base) and _inside(_block(shape, mesh_shape, c, dst), base)):
            return False
    return True


def _transfer(kind, shape, mesh_shape, coord, src, dst, dims) -> Transfer:
    """The transfer at this rank's coordinate over group ``dims`` (one that ``_fits_everywhere``)."""
    base = _block(shape, mesh_shape, coord, _replicated_on(src, dims))
    own = _block(shape, mesh_shape, coord, src)
    out = _block(shape, mesh_shape, coord, dst)
    member_pl = dst if kind == "reduce_scatter" else src
    count = math.prod(mesh_shape[d] for d in dims)
    reps = representative_coords(shape, mesh_shape, (member_pl,), dims=dims, fixed=coord)
    blocks = [(c, _block(shape, mesh_shape, c, member_pl)) for c in reps]
    row = max(math.prod(b[0]) for _, b in blocks)  # sizes are alike between representatives
    contributes = all(coord[i] == 0 for i in dims if isinstance(src[i], Replicate))
    first = _block(shape, mesh_shape, _member_coords(coord, mesh_shape, dims, 0), member_pl)
    even = _even(base, first, count, ((_member_index(c, mesh_shape, dims), b) for c, b in blocks))
    return Transfer(kind, dims, base, own, out, count, row, contributes, even,
                    where=(shape, mesh_shape, tuple(coord), member_pl))


@functools.lru_cache(maxsize=4096)
def _group_dims(kind, shape, mesh_shape, src, dst, forced) -> tuple[int, ...] | None:
    """The group of the collective: the same on every rank (it serves every coordinate), or a rank
    could pick another collective than its peers."""
    changed = {i for i in range(len(src)) if src[i] != dst[i]}
    if forced is not None and not changed <= set(forced):
        return None
    for dims in ((set(forced),) if forced is not None else (changed, _grow(changed, src, dst))):
        dims_t = tuple(sorted(dims))
        if _fits_everywhere(shape, mesh_shape, src, dst, dims_t):
            return dims_t
    return None


def _plan(kind, shape, mesh_shape, coord, src, dst, forced=None) -> Transfer | None:
    dims = _group_dims(kind, shape, mesh_shape, src, dst, forced)
    return None if dims is None else _transfer(kind, shape, mesh_shape, coord, src, dst, dims)


def _even(base: Block, first: Block, count: int, indexed_blocks) -> bool:
    """Members' blocks are equal consecutive dim-0 slices that tile the base block exactly: member
    ``j`` holds ``first`` moved by ``j`` of its rows along dim 0. ``indexed_blocks``: (member index,
    block) at representative members; equalities affine in the member index, so they decide it."""
    (bs, bo), (fs, fo) = base, first
    if not bs or tuple(fs[1:]) != tuple(bs[1:]) or tuple(fo[1:]) != tuple(bo[1:]) or fo[0] != bo[0]:
        return False
    if count * fs[0] != bs[0]:
        return False
    return all(s == fs and o[1:] == fo[1:] and o[0] == bo[0] + j * fs[0] for j, (s, o) in indexed_blocks)


def _fold_kept(shape, mesh_shape, src, dst, group=None) -> tuple:
    """``(shape, src, dst)`` with every tensor dim that one unchanged mesh dim splits (alike in both
    layouts, evenly) and no changing mesh dim touches taken as whole at its local extent: every
    member of the collective holds the same part of it, so the collective never looks inside it.
    A fused gate|up weight's ``InterleavedShard`` on TP (no block) beside its ZeRO shard on DP along
    another dim is one all-gather over DP of the local tensors then, not DTensor's fallback. Dims of a
    forced ``group`` stay: its members differ there."""
    changed = [i for i in range(len(src)) if src[i] != dst[i]]
    touched = {p.dim for i in changed for p in (src[i], dst[i]) if _is_shard_like(p)}
    splits = [p.dim for p in src if _is_shard_like(p)]
    shape, src, dst = list(shape), list(src), list(dst)
    for i, p in enumerate(src):
        if i in changed or i in (group or ()) or not _is_shard_like(p) or p.dim in touched or splits.count(p.dim) > 1:
            continue
        sections = p._split_factor_int() if _is_strided(p) else 1
        if shape[p.dim] % (mesh_shape[i] * sections):
            continue  # uneven: members' extents differ
        shape[p.dim] //= mesh_shape[i]
        src[i] = dst[i] = Replicate()
    return tuple(shape), tuple(src), tuple(dst)


@functools.lru_cache(maxsize=4096)
def _reduce_plan(shape, mesh_shape, coord, src, dst) -> Transfer | None:
    if src == dst:
        return NOTHING
    if not all(_supported(p) for p in (*src, *dst)):
        return None
    shape, src, dst = _fold_kept(shape, mesh_shape, src, dst)
    if not _blocks_only(shape, mesh_shape, src, dst):
        return None
    changed = [i for i in range(len(src)) if src[i] != dst[i]]
    if any(dst[i].is_partial() for i in changed):
        return None
    if all(src[i].is_partial() and dst[i].is_replicate() for i in changed):
        return Transfer("all_reduce", tuple(changed))
    tail = tuple(i for i in changed if src[i].is_partial() and dst[i].is_replicate())
    if tail:
        # Partial -> Replicate dims next to a scatter (SP's norm gradients: Partial on DP and TP,
        # Shard(0) on DP only): a reduce-scatter over the scatter dims, the others kept Partial, then
        # an all-reduce of the shard over them. Folding them into the reduce-scatter would move TP
        # times the bytes, and the members receiving the same block would each sum in their own
        # order: replicas differing in the last bit, which a checkpoint (one replica saved) exposes.
        mid = tuple(src[i] if i in tail else dst[i] for i in range(len(src)))
        t = _scatter_plan(shape, mesh_shape, coord, src, mid)
        return None if t is None else dataclasses.replace(t, then_all_reduce=tail)
    return _scatter_plan(shape, mesh_shape, coord, src, dst)


def _scatter_plan(shape, mesh_shape, coord, src, dst) -> Transfer | None:
    # A gradient Replicate on a mesh dim where its parameter is sharded (a vocabulary-parallel
    # weight's gradient under SP) is sliced to this rank's shard locally, for free, so that dim
    # stays out of the collective: a reduce-scatter over DP of the TP shard, not over DP x TP of
    # the whole gradient with zeros from every other TP rank.
    sliced = tuple(dst[i] if src[i].is_replicate() and _is_shard_like(dst[i]) else src[i] for i in range(len(src)))
    if sliced != src and sliced != dst and blockwise(shape, mesh_shape, sliced) and _slices_held(src, sliced, mesh_shape):
        t = _plan("reduce_scatter", shape, mesh_shape, coord, sliced, dst)
        if t is not None:
            return dataclasses.replace(t, held=_block(shape, mesh_shape, coord, src))
    return _plan("reduce_scatter", shape, mesh_shape, coord, src, dst)


def _slices_held(src, sliced, mesh_shape) -> bool:
    """Each split ``sliced`` adds to ``src`` is a block split applied after every split ``src``
    already makes of that tensor dim, so the sliced shard is a piece of the held one on every rank.
    (A gradient Replicate on TP but Shard(0) on a later CP dim holds a CP block; TP's block split
    of dim 0 would apply before CP's and ask for rows other ranks hold.)"""
    after = splits(sliced, mesh_shape)
    if after is None:
        return False
    for i, (a, b) in enumerate(zip(src, sliced)):
        if a != b:
            d, sections, before = after[i]
            held = {j for j, p in enumerate(src) if _is_shard_like(p) and p.dim == d}
            if sections != 1 or not held <= set(before):
                return False
    return True


@functools.lru_cache(maxsize=4096)
def _gather_plan(shape, mesh_shape, coord, src, dst, dims) -> Transfer | None:
    if src == dst:
        return NOTHING
    if not all(type(p) in (Shard, Replicate) or _is_strided(p) for p in (*src, *dst)):
        return None
    shape, src, dst = _fold_kept(shape, mesh_shape, src, dst, dims)
    if not _blocks_only(shape, mesh_shape, src, dst):
        return None
    changed = [i for i in range(len(src)) if src[i] != dst[i]]
    if not all(_is_shard_like(src[i]) for i in changed):
        return None  # Replicate -> Shard is a local slice: DTensor does it without communication
    return _plan("all_gather", shape, mesh_shape, coord, src, dst, dims)


def reduce_plan(shape: Sequence[int], mesh: DeviceMesh, src: Sequence[Placement], dst: Sequence[Placement]) -> Transfer | None:
    """How to reduce a gradient laid out as ``src`` to ``dst`` (a parameter's placements)."""
    return _reduce_plan(tuple(shape), tuple(mesh.shape), tuple(mesh.get_coordinate()), tuple(src), tuple(dst))


def gather_plan(
    shape: Sequence[int], mesh: DeviceMesh, src: Sequence[Placement], dst: Sequence[Placement],
    dims: tuple[int, ...] | None = None,
) -> Transfer | None:
    """How to gather a parameter from ``src`` (at rest) to ``dst`` (to run); ``dims`` forces the
    group (a superset of the dims that change), so that several parameters share one collective."""
    return _gather_plan(tuple(shape), tuple(mesh.shape), tuple(mesh.get_coordinate()), tuple(src), tuple(dst), dims)


def _slices(block: Block, base: Block):
    (s, o), (_, bo) = block, base
    return tuple(slice(o[i] - bo[i], o[i] - bo[i] + s[i]) for i in range(len(s)))


def pack_rows(local: torch.Tensor, t: Transfer) -> torch.Tensor:
    """(members, row) input of a reduce-scatter: this rank's contribution to each member's block."""
    if t.held[0] and t.held != t.src:
        local = local[_slices(t.src, t.held)]
    if t.even and t.contributes and t.src[0] == t.base[0]:
        return local.reshape(t.member_count, t.row)
    base = torch.zeros(t.base[0], dtype=local.dtype, device=local.device)
    if t.contributes:
        base[_slices(t.src, t.base)] = local
    if t.even:
        return base.reshape(t.member_count, t.row)
    rows = torch.zeros(t.member_count, t.row, dtype=local.dtype, device=local.device)
    if t.row_lengths is not None:
        return rows.masked_scatter_(_row_mask(t, rows.device), base.reshape(-1))
    for i, m in enumerate(t.members):
        blk = base[_slices(m, t.base)].reshape(-1)
        rows[i, : blk.numel()] = blk
    return rows


def unpack_row(row: torch.Tensor, t: Transfer) -> torch.Tensor:
    """This rank's output block from its (padded) reduce-scatter row."""
    return row[: math.prod(t.out[0])].view(t.out[0])


def pack_gather(local: torch.Tensor, t: Transfer) -> torch.Tensor:
    """This rank's padded row for an all-gather."""
    flat = local.reshape(-1)
    if flat.numel() == t.row:
        return flat
    row = torch.zeros(t.row, dtype=local.dtype, device=local.device)
    row[: flat.numel()] = flat
    return row


def unpack_gather(rows: torch.Tensor, t: Transfer) -> torch.Tensor:
    """This rank's output block from the gathered (members, row) tensor (contiguous). Even rows that
    are the output itself (nested ZeRO shards) are returned as a view: no copy."""
    rows = rows.view(t.member_count, t.row)
    if t.even:
        base = rows.view(t.base[0])
        return base if t.out == t.base else base[_slices(t.out, t.base)].contiguous()
    if t.row_lengths is not None:
        base = rows[_row_mask(t, rows.device)].view(t.base[0])
        return base if t.out == t.base else base[_slices(t.out, t.base)].contiguous()
    # Only the output block is assembled, from the part of each member's block inside it.
    out = torch.empty(t.out[0], dtype=rows.dtype, device=rows.device)
    for i, m in enumerate(t.members):
        common = _intersection(m, t.out)
        if common is not None:
            out[_slices(common, t.out)] = rows[i, : math.prod(m[0])].view(m[0])[_slices(common, m)]
    return out


def _row_mask(t: Transfer, device) -> torch.Tensor:
    """(members, row) booleans: the first ``row_lengths[i]`` entries of row ``i`` (the data; the rest
    is padding). In row-major order they are the base block's elements, in order."""
    lengths = t.__dict__.setdefault("_lengths_on", {})  # row_lengths per device, copied once
    on = lengths.get(device)
    if on is None:
        on = lengths[device] = t.row_lengths.to(device)[:, None]
    return torch.arange(t.row, device=device) < on


def _intersection(a: Block, b: Block) -> Block | None:
    (sa, oa), (sb, ob) = a, b
    lo = [max(x, y) for x, y in zip(oa, ob)]
    hi = [min(x + n, y + k) for x, n, y, k in zip(oa, sa, ob, sb)]
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return tuple(h - low for low, h in zip(lo, hi)), tuple(lo)
