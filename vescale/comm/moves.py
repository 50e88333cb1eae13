"""Moves between two DTensor layouts, compiled once per pair of specs.

``compile_move(src, dst)`` gives the plain-tensor function that takes a local shard laid out as
``src`` to one laid out as ``dst`` (the same global tensor). The common one-mesh-dim moves run as a
single collective, the process group's own call (``vescale.comm.direct``: no functional-collective
wrapper, whose Python autograd registration costs more than the call on small tensors, nor
torch.distributed's checking wrappers; ``all_gather_dim`` / ``reduce_scatter_dim`` pick the
cheapest form for the backend and the shard dim). Everything else (several mesh dims at once,
nested or uneven shards, other Partial ops) goes through DTensor's ``redistribute_local_tensor``
with the same specs, so every move computes what DTensor would, bit for bit
(``tests/static/test_boundary.py``), except where DTensor would compute it wrong: a move that
changes what two or more mesh dims' splits mean where a ``_StridedShard`` is involved (a fused
bias's gradient, ``(Partial, _StridedShard(0, 3))``, into its nested ZeRO shard
``(InterleavedShard(0, 2), Shard(0))``; see ``vescale.placement.nested``) goes one split at a time
(``split_steps``), each step a move DTensor gets right. ``relayout`` is that for gradients
(no autograd), where vescale would otherwise call ``DTensor.redistribute``.

Static Eager's boundary moves are built from these (``vescale.static.boundary``). In eager mode,
``redistribute`` is ``DTensor.redistribute`` (same result, same gradient placements) with the
forward and backward moves looked up by spec instead of planned by DTensor's Python redistribution
planner on every call, forward and backward.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from vescale._torch import DTensorSpec, redistribute_local_tensor, _is_shard_like, _StridedShard

from ..dispatch.metas import spec_of
from ..placement.blocks import dim_ranges, is_blockwise, representative_coords
from ..placement import splits
from . import direct

__all__ = ["compile_move", "grad_placements", "redistribute", "relayout", "split_steps", "clear_moves"]

LocalFn = Callable[[torch.Tensor], torch.Tensor]


def _is_sum(p) -> bool:
    return type(p) is Partial and p.reduce_op == "sum"


def _single_dim_move(src: DTensorSpec, dst: DTensorSpec, i: int) -> Optional[LocalFn]:
    """A move that changes mesh dim ``i`` only, as one collective, or None if it is not a common
    even case (then DTensor's own redistribution runs)."""
    a, b = src.placements[i], dst.placements[i]
    mesh = src.mesh
    n = mesh.size(i)
    group = mesh.get_group(i)
    every = (*src.placements, *dst.placements)
    if any(type(p) not in (Shard, Replicate, Partial) for p in every):
        return None  # strided or custom placements: DTensor's own path
    for p in (a, b):
        if type(p) is Shard:
            # Even, and not nested: no other mesh dim cuts the same tensor dim.
            nested = any(type(q) is Shard and q.dim == p.dim for j, q in enumerate(every)
                         if j % mesh.ndim != i and mesh.size(j % mesh.ndim) > 1)
            if nested or p.dim < 0 or src.shape[p.dim] % n:
                return None
    if type(a) is Shard and type(b) is Replicate:
        return lambda t, d=a.dim: direct.all_gather_dim(t, d, group)
    if _is_sum(a) and type(b) is Replicate:
        return lambda t: _all_reduce(t, group)
    if _is_sum(a) and type(b) is Shard:
        return lambda t, d=b.dim: direct.reduce_scatter_dim(t, d, group)
    return None


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    out = t.clone(memory_format=torch.contiguous_format)  # the input may be saved for backward
    direct.all_reduce(out, group)
    return out


# (mesh, source placements, target placements, the sizes' evenness) -> (mesh, the one-collective
# move or None): such a move reads the global shape only through whether the mesh divides its shard
# dims, so a new sequence length finds it compiled. Keyed by the mesh object (equal meshes of
# other simulated ranks hold other coordinates), which the entry keeps and checks.
_SINGLE: dict = {}


def _single_dim_move_for(src: DTensorSpec, dst: DTensorSpec, i: int) -> Optional[LocalFn]:
    n = src.mesh.size(i)
    even = tuple(d < 0 or d >= src.ndim or src.shape[d] % n == 0 for p in (src.placements[i], dst.placements[i])
                 if type(p) is Shard for d in (p.dim,))
    key = (id(src.mesh), src.placements, dst.placements, even)
    hit = _SINGLE.get(key)
    if hit is None or hit[0] is not src.mesh:
        if len(_SINGLE) >= 4096:
            _SINGLE.clear()
        hit = _SINGLE[key] = (src.mesh, _single_dim_move(src, dst, i))
    return hit[1]


def compile_move(src: DTensorSpec, dst: DTensorSpec) -> Optional[LocalFn]:
    """The local function taking a shard laid out as ``src`` to one laid out as ``dst`` (same
    global tensor), or None when nothing moves."""
    if src.placements == dst.placements:
        return None
    # A mesh dim of one rank moves nothing whatever its placements say (TP-only training's (1, N) mesh).
    changed = [i for i, (a, b) in enumerate(zip(src.placements, dst.placements)) if a != b and src.mesh.size(i) > 1]
    if not changed:
        return None
    if all(src.placements[i].is_replicate() and _is_shard_like(dst.placements[i]) for i in changed):
        fn = _local_selection(src, dst)
        if fn is not None:
            return fn
    if len(changed) == 1:
        fn = _single_dim_move_for(src, dst, changed[0])
        if fn is not None:
            return fn
    steps = split_steps(src.placements, dst.placements, tuple(src.mesh.shape))
    if steps is not None:
        return _chain(src, steps)
    return lambda t: redistribute_local_tensor(t.contiguous(), src, dst)


def _default_order(spec: DTensorSpec) -> bool:
    return spec.use_strided_shard_as_shard_order or spec.shard_order == DTensorSpec.compute_default_shard_order(spec.placements)


def _local_selection(src: DTensorSpec, dst: DTensorSpec) -> Optional[LocalFn]:
    """A move that only shards Replicate mesh dims: this rank's target piece is a part of its source
    piece, picked by arithmetic on the two layouts (``vescale.placement.blocks``) at this rank's
    coordinate. DTensor's own ``Replicate -> Shard`` cuts the local tensor into as many chunks as the
    mesh dim has ranks to keep one (a view per rank: time that grows with the world); this costs a
    ``narrow`` per sharded tensor dim (a ``cat`` of narrows for an ``InterleavedShard``'s sections).
    None where the target piece is not inside the source piece (DTensor's path then runs)."""
    if not (_default_order(src) and _default_order(dst)):
        return None
    coord = src.mesh.get_coordinate()
    shape, mesh_shape = tuple(src.shape), tuple(src.mesh.shape)
    if coord is None or not picks_everywhere(shape, mesh_shape, tuple(src.placements), tuple(dst.placements)):
        return None  # the same answer on every rank: none may run DTensor's collectives alone
    return functools.partial(select, picks=local_picks(shape, mesh_shape, coord, src.placements, dst.placements))


@functools.lru_cache(maxsize=4096)
def picks_everywhere(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], src: tuple[Placement, ...], dst: tuple[Placement, ...]
) -> bool:
    """Whether every coordinate's ``dst`` piece is inside its ``src`` piece (``local_picks`` finds
    it at each), decided without looking at every rank: a tensor dim ``src`` does not split is
    whole on every rank; one it splits must be one block in both layouts, and block containment is
    decided at representative coordinates (``vescale.placement.blocks``)."""
    split = {p.dim for p in src if _is_shard_like(p)} & {p.dim for p in dst if _is_shard_like(p)}
    if not split:
        return True
    if not (is_blockwise(shape, mesh_shape, src) and is_blockwise(shape, mesh_shape, dst)):
        return False
    for c in representative_coords(shape, mesh_shape, (src, dst)):
        for d in split:
            (s, n), = dim_ranges(shape[d], d, mesh_shape, c, src) or ((shape[d], 0),)
            want = dim_ranges(shape[d], d, mesh_shape, c, dst)
            if want and not (s <= want[0][0] and want[0][0] + want[0][1] <= s + n):
                return False
    return True


def local_picks(
    shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int], src: Sequence[Placement], dst: Sequence[Placement]
) -> tuple | None:
    """Per tensor dim that changes, the position ranges of the local tensor laid out as ``src`` at
    ``coord`` that hold its piece under ``dst``; None if that piece is not inside it."""
    picks = []
    for d in sorted({p.dim for p in dst if _is_shard_like(p)}):
        have = dim_ranges(shape[d], d, mesh_shape, coord, src)
        want = dim_ranges(shape[d], d, mesh_shape, coord, dst)
        if have == want:
            continue
        positions = _positions(have, want)
        if positions is None:
            return None
        picks.append((d, tuple(positions)))
    return tuple(picks)


def _positions(have, want):
    """Where the global index ranges ``want`` sit in a local tensor holding ``have`` (both in local
    order), as position ranges; None if some index of ``want`` is not held."""
    out = []
    for g, n in want:
        at = 0
        for s, m in have:
            if s <= g and g + n <= s + m:
                out.append((at + g - s, n))
                break
            at += m
        else:
            return None
    return out


def select(t: torch.Tensor, picks: tuple) -> torch.Tensor:
    """The part of ``t`` that ``local_picks`` names (contiguous)."""
    for d, positions in picks:
        if len(positions) == 1:
            t = t.narrow(d, *positions[0])
        elif not positions:
            t = t.narrow(d, 0, 0)
        else:
            t = torch.cat([t.narrow(d, s, n) for s, n in positions], dim=d)
    return t.contiguous()


@functools.lru_cache(maxsize=4096)
def split_steps(src: tuple, dst: tuple, mesh_shape: tuple) -> tuple | None:
    """The layouts to go through from ``src`` to ``dst`` (the last one ``dst``), one split changed
    per step, where a ``_StridedShard`` is involved and more than one mesh dim's split changes
    meaning (``vescale.placement.splits``), or one changes into another split; None where DTensor's
    redistribution takes the move in one go. First the changed splits of ``src`` are undone, the
    last applied first (a nested ZeRO shard before the TP split it sits in), then those of ``dst``
    made, the first applied first (the TP split, then the ZeRO shard inside it); a Partial goes
    straight to its target. Each step is a move DTensor gets right (``tests/comm/test_split_steps.py``;
    on gloo, every layout pair with a ``_StridedShard`` on (2, 2), (4, 2), (2, 4) and (2, 2, 2) meshes)."""
    if not any(isinstance(p, _StridedShard) for p in (*src, *dst)):
        return None
    a, b = splits(src, mesh_shape), splits(dst, mesh_shape)
    if a is None or b is None:
        return None  # a strided layout this does not read: DTensor's as before

    def meaning(x: Any) -> Any:  # mesh dims of one rank split nothing
        return (x[0], x[1], tuple(j for j in x[2] if mesh_shape[j] > 1)) if isinstance(x, tuple) else x

    changed = [i for i in range(len(src)) if mesh_shape[i] > 1 and meaning(a[i]) != meaning(b[i])]
    if not changed or (len(changed) == 1 and not all(isinstance(x[changed[0]], tuple) for x in (a, b))):
        return None  # one split made, undone or reduced: one step DTensor gets right
    steps, cur = [], list(src)

    def step(i: int, p: Placement) -> None:
        if cur[i] != p:
            cur[i] = p
            steps.append(tuple(cur))

    for i in sorted((i for i in changed if isinstance(a[i], tuple)), key=lambda i: -len(a[i][2])):
        step(i, Replicate())
    for i in sorted((i for i in changed if isinstance(b[i], tuple)), key=lambda i: len(b[i][2])):
        step(i, dst[i])
    for i in changed:
        step(i, dst[i])
    return tuple(steps)


def _chain(src: DTensorSpec, steps: tuple) -> LocalFn:
    """One local function for the moves from ``src`` through ``steps`` (placements), each compiled
    as a move of its own (one mesh dim each)."""
    moves, at = [], src
    for placements in steps:
        nxt = spec_of(src.mesh, placements, src.tensor_meta)
        move = compile_move(at, nxt)
        if move is not None:
            moves.append(move)
        at = nxt

    def run(t: torch.Tensor) -> torch.Tensor:
        for move in moves:
            t = move(t)
        return t

    return run


# ---------------------------------------------------------------------------------------------
# Eager mode: DTensor.redistribute through compiled moves
# ---------------------------------------------------------------------------------------------

# (id(mesh), source spec, target placements) -> (move, target spec, mesh); the same for a gradient
# spec in backward. Specs hold shapes, so a model run at many sequence lengths
# adds entries: the table is dropped when it grows past _MOVES_KEPT (rebuilt at a few us each).
_MOVES: dict = {}
_MOVES_KEPT = 4096


def _move_to(spec: DTensorSpec, placements: tuple) -> tuple:
    # Keyed by the mesh object too: a move holds its mesh's process group and coordinates, and
    # DeviceMesh equality (inside spec equality) ignores both; the entry keeps the mesh alive.
    mesh = spec.mesh
    key = (id(mesh), spec, placements)
    hit = _MOVES.get(key)
    if hit is None or hit[2] is not mesh:
        if len(_MOVES) >= _MOVES_KEPT:
            _MOVES.clear()
        target = spec_of(mesh, placements, spec.tensor_meta)
        hit = _MOVES[key] = (compile_move(spec, target), target, mesh)
    return hit


def clear_moves() -> None:
    """Forget the compiled moves: they hold the process groups and coordinates of the meshes they
    were compiled on, and ``_MOVES`` finds them by spec equality, which ignores the rank (a rank
    forked from a process that simulated another must not run that one's moves)."""
    _MOVES.clear()
    _SINGLE.clear()


def grad_placements(grad: tuple, src: tuple) -> tuple:
    """Where DTensor's redistribute hands a gradient back: the source placements, but a Partial
    source takes a gradient that arrives Shard or Replicate as Replicate (no reduce is undone), and
    one that arrives Partial of another kind as it arrives.

    The last case is a vocabulary-parallel lookup whose ``_MaskPartial`` output is all-reduced (no
    sequence parallelism) and whose gradient comes back ``Partial(sum)`` from the column-parallel
    layers that read it: DTensor would move ``P(sum) -> MaskP(sum)``, which it cannot (an
    ``AssertionError`` in its redistribution). Either is the same global gradient; the lookup's
    backward (``embedding_dense_backward``) takes a ``Partial(sum)`` gradient as it is and gives the
    table a ``Partial(sum)`` gradient, which the gradient reduction reduce-scatters to the table's
    rows like any other (issue 27, defect 3)."""
    return tuple(Replicate() if (_is_shard_like(g) or g.is_replicate()) and s.is_partial()
                 else g if g.is_partial() and s.is_partial() and g != s else s
                 for g, s in zip(grad, src))


def _own(move: Optional[LocalFn], local: torch.Tensor) -> torch.Tensor:
    """``local`` moved (None: nothing moves, only placements on mesh dims of one rank change), in
    storage of its own. A compiled ``Replicate -> Shard`` move returns a view of its input (a static
    step's activations need no copy); DTensor's redistribute clones there, and a parameter sharded
    by ``parallelize`` must not keep the whole tensor alive."""
    moved = local if move is None else move(local)
    if moved.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
        return moved.clone()
    return moved


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, d: DTensor, move: Optional[LocalFn], spec: DTensorSpec) -> DTensor:
        ctx.src = d._spec
        local = d._local_tensor
        return DTensor(_own(move, local), spec, requires_grad=d.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor, None, None]:
        src = ctx.src
        want = grad_placements(grad.placements, src.placements)
        if torch.is_grad_enabled():  # a differentiable backward (double backward): DTensor's own
            return grad.redistribute(src.mesh, want), None, None
        if tuple(grad.placements) == want:
            return grad, None, None
        move, spec, _ = _move_to(grad._spec, want)  # laid out anew, shaped as the gradient
        local = grad._local_tensor
        return DTensor(_own(move, local), spec, requires_grad=False), None, None


def relayout(d: DTensor, placements: Sequence[Placement]) -> DTensor:
    """A gradient (no autograd) laid out as ``placements``: ``DTensor.redistribute``, except for the
    moves it gets wrong (``split_steps``), which go one split at a time."""
    placements = tuple(placements)
    if split_steps(tuple(d.placements), placements, tuple(d.device_mesh.shape)) is None:
        return d.redistribute(d.device_mesh, placements)
    move, spec, _ = _move_to(d._spec, placements)
    return DTensor(_own(move, d._local_tensor), spec, requires_grad=False)


def redistribute(d: DTensor, placements: tuple) -> DTensor:
    """``d.redistribute(d.device_mesh, placements)`` (default dtypes, synchronous), with the moves
    compiled once per layout pair; ``placements`` must differ from ``d``'s."""
    if any(p.is_partial() and p != q for p, q in zip(placements, d.placements)):
        return d.redistribute(d.device_mesh, placements)  # DTensor's error: a Partial target is its internal use
    move, spec, _ = _move_to(d._spec, tuple(placements))
    return _Redistribute.apply(d, move, spec)
