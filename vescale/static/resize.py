"""Record reuse across sizes: a new sequence length (or batch size) derives its record from an old one.

Why: a static step with root input shapes never seen before used to record again, a whole eager
DTensor step under the op watcher and then a checking step, 3-8x the cost of a cached step on the
zoo LLaMA. Yet what a record holds hardly depends on the sizes: which modules stay eager, the
placements at every boundary, the gradients' placements, the random ops and the moves are decided
by the model's code and the plan. Only the *sizes* in it change: the global shapes in the crossing
specs (and the gradient specs, moves and random replays made from them) and the local shapes of
sized ops. So when a new key differs from a recorded one only in tensor sizes (same tensors,
dtypes, ranks and training flags), ``derive`` copies the record with every size left open.

How a size is settled. Each root input dim that changed gives a pair old -> new (and so does each
product of the changed dims of one input: a ``(batch, seq)`` input flattened to ``batch * seq`` rows
in the loss changes by both). A recorded global dim of size ``v`` becomes the set of *candidates*
``v`` (a dim not derived from the input: hidden, heads, vocab) and, where ``v = k * old``, ``k * new``
(one derived from it: seq, batch * seq, 4 * seq). Which
one it is cannot be told from the record (``head_dim == seq``: the zoo LLaMA's rotary (1, 16, 16)),
so the first static step of the derived record settles each spec from the tensor that actually
crosses there: its local size picks the candidate whose shard has that size (a dim no rank splits
takes its local size, candidate or not: a slice one shorter than the sequence). Every candidate of a
sharded dim must divide evenly by the ranks sharding it, checked before the step from the root
shapes alone, so every rank settles the same way and the local size identifies one candidate.
A crossing whose local size of a split dim fits no candidate, or a DTensor arriving from an eager module with
other placements or shape than derived, raises ``ResizeMismatch`` naming the spot; the runtime then
forgets the derived record and the step, run again, records (nothing of the failed step is kept but
its random draws). Where the source record's own first static step has not run yet, the derived
one's first step also runs the op watcher, checking each sized op's local shape against its
candidates (``ShapeCandidates``); otherwise it runs without (``checked_before``).

When it does not derive (and the step records as before): an uneven shard for some candidate
(the mesh does not divide the new length), a changed dim of size 1 (unit dims change DTensor's
decisions), a sharded dim with a placement other than ``Shard`` whose size would change, a view with
gaps whose outermost dim is not the one that may change (its strides for other sizes are unknown),
or ops with data-dependent output sizes in the recording (``nonzero``, ``.item()`` of a number,
boolean indexing, ``bincount``: routing by token lists), whose sizes no pair describes.

Parameters keep their shapes: parameter gradient specs, ``ParamShadow``s, masked vocabulary
lookups and local cross-entropy kernels (their class counts are the vocabulary's; rows are not
recorded) carry over unchanged.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch.distributed.tensor import Shard
from vescale._torch import DTensorSpec, TensorMeta

from ..dispatch.metas import contiguous_strides, with_meta
from ..plan.ir import PlanError
from ..placement.blocks import local_shape_and_offset

if TYPE_CHECKING:
    from .record import Crossing, Record

__all__ = ["ResizeMismatch", "size_factors", "derive", "data_dependent_op", "Pending", "ShapeCandidates", "settle", "finish"]

aten = torch.ops.aten


class ResizeMismatch(PlanError):
    """A derived record's size does not fit the tensor that crossed: the step must record."""


# ---------------------------------------------------------------------------------------------
# Which keys can share a record, and the size factors between them
# ---------------------------------------------------------------------------------------------


def size_factors(old_key: tuple, new_key: tuple) -> tuple[tuple[int, int], ...] | None:
    """How sizes recorded for ``old_key`` may change for ``new_key``: ``(old, new)`` products of the
    changed dims of one root input; None if the keys differ in more than sizes (tensor count, dtype,
    rank, training flags) or a changed dim is or becomes 1."""
    (old_tensors, old_flags), (new_tensors, new_flags) = old_key, new_key
    if old_flags != new_flags or len(old_tensors) != len(new_tensors):
        return None
    factors = set()
    for (old_shape, old_dtype), (new_shape, new_dtype) in zip(old_tensors, new_tensors):
        if old_dtype != new_dtype or len(old_shape) != len(new_shape):
            return None
        changed = [(a, b) for a, b in zip(old_shape, new_shape) if a != b]
        if any(min(a, b) <= 1 for a, b in changed):
            return None  # a unit or empty dim: DTensor decides differently on them
        # Every product of this input's changed dims (batch, seq, batch * seq).
        for n in range(1, len(changed) + 1):
            for subset in itertools.combinations(changed, n):
                old, new = math.prod(a for a, _ in subset), math.prod(b for _, b in subset)
                if old != new:
                    factors.add((old, new))
    return tuple(sorted(factors)) if factors else None


def _candidates(v: int, factors) -> tuple[int, ...]:
    """The global sizes a dim recorded as ``v`` may have now: ``v`` itself first, then ``k * new`` for
    every ``v == k * old``: a dim derived from the inputs is a whole multiple of the dims it comes
    from (seq, batch * seq, heads * seq), not a fraction of them. (A fraction would also make
    intrinsic sizes smaller than the inputs, such as a head count, look derived, and often uneven.)"""
    out = [v]
    for old, new in factors:
        if v % old == 0 and v // old * new not in out:
            out.append(v // old * new)
    return tuple(out)


def _local_candidates(v: int, factors) -> tuple[int, ...]:
    """The local sizes a sized op's output dim recorded as ``v`` may have now: ``v`` and every whole
    ``v * new / old`` (a shard of a derived dim is a fraction of the input's dims)."""
    out = [v]
    for old, new in factors:
        if v * new % old == 0 and v * new // old not in out:
            out.append(v * new // old)
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# Ops whose output sizes depend on values (no factor describes them)
# ---------------------------------------------------------------------------------------------

_DATA_DEPENDENT = {
    aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
    aten.unique_dim.default, aten.unique_consecutive.default, aten.repeat_interleave.Tensor, aten.bincount.default,
}


def data_dependent_op(func: Callable[..., Any], args: tuple) -> bool:
    """Whether ``func`` makes sizes from values: a record containing one is not derived."""
    if func in _DATA_DEPENDENT:
        return True
    if func is aten._local_scalar_dense.default:
        # ``.item()`` / ``.tolist()``: a number that may become a size. A bool cannot: it steers control
        # flow (HF's mask code asks ``(...).all()``), which static mode assumes the same every step anyway.
        return not (isinstance(args[0], torch.Tensor) and args[0].dtype == torch.bool)
    if func is aten.index.Tensor and len(args) > 1:
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ())
    return False


# ---------------------------------------------------------------------------------------------
# Open sizes and settling them
# ---------------------------------------------------------------------------------------------


def _shard_counts(placements, mesh, ndim: int) -> list:
    """Per tensor dim, how many ranks split it (plain ``Shard`` placements); None for a dim another
    Shard-like placement (strided, interleaved) splits."""
    counts: list = [1] * ndim
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            d = p.dim % ndim if ndim else p.dim
            if type(p) is Shard and counts[d] is not None:
                counts[d] *= mesh.size(i)
            else:
                counts[d] = None
    return counts


def _dense_order(shape, stride) -> list | None:
    """The dims from outermost to innermost if ``stride`` is a dense (possibly permuted, possibly
    broadcast: stride 0) layout of ``shape``, else None (a view with gaps: its stride for other sizes
    is unknown)."""
    dims = [d for d in range(len(shape)) if stride[d] != 0 and shape[d] != 1]
    dims.sort(key=lambda d: -stride[d])
    expect = 1
    for d in reversed(dims):
        if stride[d] != expect:
            return None
        expect *= shape[d]
    return dims


def _outer_only(shape, stride, open_dims: list) -> bool:
    """Whether a view with gaps (a slice of a wider tensor: gate of a fused gate|up) may change size
    keeping its strides: only its outermost dim may change."""
    if len(open_dims) != 1:
        return False
    d = open_dims[0]
    return all(stride[d] >= stride[e] * shape[e] for e in range(len(shape)) if e != d and stride[e] != 0)


def _restride(old_shape, old_stride, new_shape) -> tuple:
    """The stride a tensor laid out like the old one has at ``new_shape``."""
    if tuple(old_stride) == contiguous_strides(old_shape):
        return contiguous_strides(new_shape)
    order = _dense_order(old_shape, old_stride)
    if order is None:  # a view with gaps whose outermost dim changed (``_outer_only``)
        return tuple(old_stride)
    stride = [0] * len(new_shape)
    expect = 1
    for d in reversed(order):
        stride[d] = expect
        expect *= new_shape[d]
    # Unit dims keep a stride that fits where they sit (their stride never matters for indexing).
    for d in range(len(new_shape)):
        if old_stride[d] != 0 and old_shape[d] == 1:
            stride[d] = max((stride[e] * new_shape[e] for e in range(d + 1, len(new_shape)) if old_stride[e] != 0), default=1)
    return tuple(stride)


@dataclasses.dataclass
class _Shared:
    """What the open sizes of one derived record share: the specs and moves made so far, so that the
    many spots recorded with one spec get one new spec (and one move) for the same sizes."""

    specs: dict = dataclasses.field(default_factory=dict)  # (recorded spec, new shape) -> spec
    moves: dict = dataclasses.field(default_factory=dict)  # (src spec, dst spec, grad placements) -> Move
    opened: dict = dataclasses.field(default_factory=dict)  # (recorded spec, grad placements) -> (candidates, counts)
    local_shapes: dict = dataclasses.field(default_factory=dict)  # id(spec) -> (spec, this rank's shard shape)


@dataclasses.dataclass
class Pending:
    """A recorded spec whose global sizes are open: per dim its candidates (the recorded size first)."""

    spec: DTensorSpec
    candidates: tuple  # per dim, a tuple of ints
    counts: list  # per dim, the ranks splitting it (None: not a plain Shard)
    where: str  # for messages
    shared: _Shared
    settled: DTensorSpec | None = None

    def settle(self, local_shape: Sequence[int]) -> DTensorSpec:
        """The spec whose shard on this rank has ``local_shape``."""
        if self.settled is not None:
            return self.settled
        if len(local_shape) != len(self.candidates):
            raise self._mismatch(local_shape)
        shape = []
        for size, options, n in zip(local_shape, self.candidates, self.counts):
            if n == 1:
                # No rank splits this dim: its global size is the local one, whatever the record
                # derived (a slice one shorter than the sequence, say, follows no factor).
                shape.append(size)
                continue
            # An open dim is split by plain Shards only, and every candidate evenly (``_open``).
            fit = [c for c in options if c // n == size] if len(options) > 1 else list(options)
            if not fit:
                raise self._mismatch(local_shape)
            shape.append(fit[0])
        # Every dim, open or not, must give this rank's shard its size (DTensor's own arithmetic:
        # uneven and Shard-like dims too), or the tensor is not the one derived for this spot.
        spec = self._spec_for(tuple(shape))
        if self._local_shape(spec) != tuple(local_shape):
            raise self._mismatch(local_shape)
        self.settled = spec
        return spec

    def _local_shape(self, spec: DTensorSpec) -> tuple:
        """This rank's shard shape of ``spec``, once per spec of this record (many spots share one)."""
        found = self.shared.local_shapes.get(id(spec))
        if found is None or found[0] is not spec:
            local, _ = local_shape_and_offset(spec.shape, spec.mesh, spec.placements, skip_offset=True)
            found = self.shared.local_shapes[id(spec)] = (spec, tuple(local))
        return found[1]

    def settle_global(self, shape: tuple) -> DTensorSpec:
        """The spec with global ``shape`` (a move's target: the same global tensor as its source)."""
        if self.settled is None:
            if any(s not in options and n != 1 for s, options, n in zip(shape, self.candidates, self.counts)):
                raise ResizeMismatch(f"{self.where}: global shape {shape} fits none of the sizes derived for it")
            self.settled = self._spec_for(tuple(shape))
        return self.settled

    def _spec_for(self, shape: tuple) -> DTensorSpec:
        meta = self.spec.tensor_meta
        if shape == tuple(meta.shape):
            return self.spec
        key = (self.spec, shape)
        spec = self.shared.specs.get(key)
        if spec is None:
            stride = _restride(tuple(meta.shape), tuple(meta.stride), shape)
            meta = TensorMeta(torch.Size(shape), stride, meta.dtype)
            spec = self.shared.specs[key] = with_meta(self.spec, meta)
        return spec

    def _mismatch(self, local_shape) -> ResizeMismatch:
        return ResizeMismatch(
            f"{self.where}: a local tensor of shape {tuple(local_shape)} crossed where the record derived for the "
            f"new input sizes allows global sizes {list(self.candidates)} on {list(self.spec.placements)}: a size "
            f"there does not follow the inputs' sizes; the step records instead (run it again), or set "
            f"reuse_records = False on the model's static runtime to always record"
        )


@dataclasses.dataclass
class ShapeCandidates:
    """A sized op's local output shape in a derived record: per dim, the sizes it may have."""

    candidates: tuple

    def check(self, module: str, func: Callable[..., Any], shape: Sequence[int] | None) -> None:
        if shape is None or len(shape) != len(self.candidates) or any(s not in c for s, c in zip(shape, self.candidates)):
            raise ResizeMismatch(
                f"module {module!r}: {func} gives a local shape {shape} in the first static step of a record "
                f"derived for new input sizes, which allows {list(self.candidates)}: a size there does not "
                f"follow the inputs' sizes; the step records instead (run it again)"
            )


def settle(c: Crossing, t: torch.Tensor) -> None:
    """Settle crossing ``c`` (``record.Crossing`` with ``pending``) from the tensor crossing there: a
    local tensor, or a DTensor (whose placements and shape must be those derived)."""
    pending, c.pending = c.pending, None
    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    try:
        spec = pending.settle(tuple(local.shape))
    except ResizeMismatch:
        c.pending = pending
        raise
    actual = getattr(t, "_spec", None)
    if actual is not None and (actual.placements != spec.placements or actual.shape != spec.shape):
        c.pending = pending
        raise ResizeMismatch(
            f"{pending.where}: a DTensor {list(actual.placements)} of shape {tuple(actual.shape)} arrived where the "
            f"record derived for the new input sizes has {list(spec.placements)} of shape {tuple(spec.shape)}: "
            f"an eager module decides differently at these sizes; the step records instead (run it again)"
        )
    c.spec = spec


class LazyMove:
    """A precompiled move of a derived record, compiled at its first call, once the crossing tensor
    settles its source spec (the target is the same global tensor)."""

    def __init__(self, src, dst, make_move):
        self.src, self.dst, self.make_move = src, dst, make_move
        self.shared = (src.pending or dst.pending).shared
        self.move = None

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.move is None:
            if self.src.pending is not None:
                settle(self.src, t)
            if self.dst.pending is not None:
                self.dst.spec = self.dst.pending.settle_global(tuple(self.src.spec.shape))
                self.dst.pending = None
            src, dst = self.src, self.dst
            key = (src.spec, dst.spec, dst.grad_placements, src.leave_grad)
            self.move = self.shared.moves.get(key)
            if self.move is None:
                self.move = self.shared.moves[key] = self.make_move(src, dst)
        return self.move(t)


# ---------------------------------------------------------------------------------------------
# Deriving a record
# ---------------------------------------------------------------------------------------------


class _Refused(Exception):
    pass


def _pending(spec: DTensorSpec | None, factors, shared: _Shared, where: str, grad_placements=()) -> Pending | None:
    """``spec`` with its sizes open; refuses (``_Refused``) where a candidate would shard unevenly."""
    if spec is None:
        return None
    key = (spec, grad_placements)
    opened = shared.opened.get(key)
    if opened is None:
        opened = shared.opened[key] = _open(spec, factors, where, grad_placements)
    return Pending(spec, *opened, where, shared)


def _open(spec: DTensorSpec, factors, where: str, grad_placements) -> tuple:
    """Per dim of ``spec``, its candidate sizes and the ranks splitting it."""
    meta = spec.tensor_meta
    if meta is None:
        raise _Refused(f"{where}: recorded without tensor metadata")
    shape, ndim = tuple(meta.shape), len(meta.shape)
    candidates = tuple(_candidates(v, factors) for v in shape)
    stride = tuple(meta.stride)
    if any(len(c) > 1 for c in candidates) and _dense_order(shape, stride) is None:
        # A view with gaps (gate of a fused gate|up): the pitch between its rows is some wider
        # tensor's, so only its outermost dim can follow the inputs with the strides kept; the
        # others stay as recorded (and the first step checks that they do).
        outer = max(range(len(shape)), key=lambda d: stride[d])
        candidates = tuple(c if d == outer else c[:1] for d, c in enumerate(candidates))
        if not _outer_only(shape, stride, [outer]):
            raise _Refused(f"{where}: stride {stride} is not a dense layout of {shape}")
    counts = _shard_counts(spec.placements, spec.mesh, ndim)
    for placements in [spec.placements, *[g for g in grad_placements if g is not None]]:
        for d, n in enumerate(_shard_counts(placements, spec.mesh, ndim)):
            if len(candidates[d]) == 1:
                continue
            if n is None:
                raise _Refused(f"{where}: dim {d} of size {shape[d]} may change but is split by {list(placements)}")
            uneven = [c for c in candidates[d] if c % n]
            if uneven:
                raise _Refused(f"{where}: dim {d} may become {uneven[0]}, which {n} ranks do not split evenly")
    return candidates, counts


def derive(
    source: Record, factors: tuple[tuple[int, int], ...], record_cls: type[Record], crossing_cls: type[Crossing]
) -> tuple[Any, str]:
    """A record for new input sizes from the verified record ``source`` (see the module docstring):
    ``(record, "")``, or ``(None, why not)``."""
    if source.data_dependent:
        module, op = next(iter(source.data_dependent.items()))
        return None, f"module {module!r} runs {op}, whose output size depends on values"
    shared = _Shared()
    try:
        crossings = {}
        for key, c in source.crossings.items():
            where = f"module {key[0]!r} {key[1]} #{key[2]}"
            pending = _pending(c.spec, factors, shared, where, (c.grad_placements, c.leave_grad))
            crossings[key] = crossing_cls(c.spec, c.grad_placements, c.leave_grad, pending=pending)
        random = {
            module: [[_pending(s, factors, shared, f"module {module!r} random op #{k}") for s in specs] for k, specs in enumerate(ops)]
            for module, ops in source.random.items()
        }
    except _Refused as e:
        return None, str(e)
    shapes = {
        module: [None if s is None else ShapeCandidates(tuple(_local_candidates(v, factors) for v in s)) for s in found]
        for module, found in source.shapes.items()
    }
    # Quiet modules (program.find_quiet) are quiet whatever the sizes: nothing crosses their
    # boundaries. Their decided steps carry over (program.decide), so the first step runs
    # them quiet already (and so are ZeRO-3 units run as one: their members are quiet modules).
    quiet = dict(source.quiet) if source.quiet is not None else None
    rec = record_cls(
        crossings=crossings, quiet=quiet, param_grads=dict(source.param_grads), unsafe=dict(source.unsafe), shapes=shapes,
        random=random, assumed_eager=source.assumed_eager, complete=True, checked=False,
        param_grad_specs=dict(source.param_grad_specs), keys=dict(source.keys), lookups=source.lookups,
        masked=set(source.masked), random_funcs=source.random_funcs, losses=source.losses, sizes=source.sizes,
        size_sites=source.size_sites, resized_from=source,
        quiet_units=source.quiet_units, units_off=dict(source.units_off),
    )
    return rec, ""


def checked_before(rec: Record) -> bool:
    """Whether ``rec``'s first static step can run without the op watcher: a record derived from one
    whose own first static step checked the local shapes of its sized ops. That check catches code
    that computes a global size where sharding needs a local one (a head count from the config), which
    the sizes do not change; what they change, the specs at the crossings and of the random ops, the
    first step settles and checks from the tensors themselves. The watcher would cost that step a
    Python call per op."""
    return rec.resized_from is not None and rec.resized_from.verified


def replay_spec(specs: list, j: int, a: torch.Tensor) -> DTensorSpec | None:
    """The j-th recorded spec of a random op, settled from its argument ``a`` if it is open."""
    spec = specs[j]
    if isinstance(spec, Pending):
        spec = specs[j] = spec.settle(tuple(a.shape))
    return spec


def finish(rec: Record) -> None:
    """After a derived record's first static step ran through: open sizes that can only be one
    value are settled too (export shows them), precompiled moves replace their lazy wrappers."""
    for c in rec.crossings.values():
        if c.pending is not None and all(len(o) == 1 for o in c.pending.candidates):
            c.spec, c.pending = c.pending.spec, None
    for moves in rec.moves.values():
        for i, m in enumerate(moves or ()):
            if isinstance(m, LazyMove) and m.move is not None:
                moves[i] = m.move
