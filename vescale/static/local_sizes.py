"""Local size arguments: a static body's ``view`` / ``reshape`` / ``split`` given a global size gets the local one.

A module may reshape a sharded tensor with a size read from its config rather than from the tensor:
HF's causal-LM loss does ``logits.view(-1, config.vocab_size)`` on the logits, which a
vocabulary-parallel LM head leaves split along the vocabulary. On DTensors that is right: DTensor's
view rule turns the global sizes into the local ones. On the local shards the same call either fails
or, where a ``-1`` absorbs the difference, silently makes another shape (``(rows / n, vocab)`` for
``(rows, vocab / n)``). The first static step's shape check catches it; until this module the only
remedy was to keep the module eager (and a plan for HF's models gathered the logits for it). The
same holds for a fused projection cut into sections of a config size: GPT-2's attention does
``c_attn(x).split(embed_dim, dim=2)`` on q|k|v split by heads (``InterleavedShard``), whose local
sections are ``embed_dim / n`` wide.

Slices are the same: a section-aligned slice of an ``InterleavedShard`` dim (HF Phi-3's
``qkv[..., :query_pos]``, ``narrow``) runs on the local shard with local bounds under DTensor
(``vescale.dispatch.fast.interleaved``), while the model passes the global ones (``SlicedCall``).

The recorded facts fix it, as they fix the vocabulary-parallel lookup (``local_ops.py``):

* **Recording** (``size_rewrite``): each ``view`` / ``reshape`` / ``split`` call of a module's own
  body is noted in call order (``local_calls.CallWatch``). For one on a DTensor whose explicit sizes
  differ from those its local output takes (a view's local shape, a split's local section size), a
  ``SizeRewrite`` keeps those positions: the global size the model passed and the local size DTensor
  used. Every other call is noted as None (the call as it is; a split into listed sections too).
* **Static steps** (``local_calls.LocalCalls``): the k-th call gets its rewritten positions' local
  sizes. A ``-1`` stays ``-1`` (inferred from the local tensor: a new sequence length changes it),
  other positions stay as passed. A size the model reads from the tensor itself (the zoo LLaMA's
  ``repeat_kv`` reshapes by ``x.shape``) was global while recording, on the DTensor, and is local
  in static steps already: a call that passes the local sizes runs as it is, and its note is
  dropped for good (``SizeRewrite.local`` returns None), so a body with nothing left to rewrite runs
  without the mode from the next step on. A whole share of the global size (read from another
  tensor's shard, split over fewer ranks: HF Mixtral's MoE block reshapes its DP x EP split output
  by the batch of its DP-split input) gets the local size too. Any other size at a rewritten position is another tensor
  than the recorded one, except in a record derived for new input sizes (``resize.py``) from one
  whose first static step kept the rewrite (so the call passes a global size): there a global size
  that follows the inputs (a sequence length the model reads from an unsplit tensor) is split as
  the recorded one was, over ``global / local`` ranks, evenly (else ``resize.ResizeMismatch``: the
  step records instead).

The first static step's shape check still runs over the rewritten call, so a rewrite that did not
give DTensor's local shape fails there, naming the module and op.

The other way round, a plain tensor (the global tensor, the same on every rank) may be sized from a
local shard in static steps where the recording read the global size from the DTensor: HF's mask
code expands the position ids to the batch size of the DP-split embeddings. Every ``view`` /
``reshape`` / ``split`` / ``expand`` call on a plain tensor is noted with its sizes
(``GlobalSizes``); the first static step drops the note where the sizes are the recorded ones, or
learns where the body passes a whole share of a recorded size and gives the call the global size
there in every step. (``expand`` of a DTensor is not rewritten: an expanded dim's gradient is a sum,
whose layout in static steps the recording does not see.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.distributed.tensor import DTensor

from ..plan.ir import PlanError
from .resize import ResizeMismatch

__all__ = ["SIZED_CALLS", "GlobalSizes", "SizeRewrite", "SizedCall", "size_call", "size_rewrite"]

_SPLITS = (torch.Tensor.split, torch.split)
_SLICES = (torch.Tensor.__getitem__, torch.Tensor.narrow, torch.narrow)
# The torch functions whose sizes are rewritten: what models call to reshape or broadcast by a config
# size, and to cut a fused projection into sections of a config size (GPT-2's ``split(embed_dim, dim=2)``,
# Phi-3's ``qkv[..., :query_pos]``).
SIZED_CALLS = frozenset({torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.expand, *_SPLITS, *_SLICES})


@dataclass(frozen=True)
class SizedCall:
    """One ``SIZED_CALLS`` call: its tensor, its sizes (a split's: its section size), for a split
    the dim it cuts, and the function."""

    tensor: torch.Tensor
    sizes: tuple
    func: Callable
    split_dim: int | None = None

    def local_sizes(self, out: Any) -> tuple | None:
        """The sizes this call would take to give ``out``'s local tensors (None: not a DTensor result)."""
        if self.split_dim is None:
            return tuple(out._local_tensor.shape) if isinstance(out, DTensor) else None
        if not isinstance(out, (tuple, list)) or not out or not isinstance(out[0], DTensor):
            return None
        return (out[0]._local_tensor.shape[self.split_dim],)  # every piece but the last has the section size

    def run(self, sizes: tuple) -> Any:
        """The call again with ``sizes``."""
        if self.split_dim is None:
            return self.func(self.tensor, sizes)
        return self.func(self.tensor, sizes[0], dim=self.split_dim)


def size_call(func: Callable[..., Any], args: tuple, kwargs: dict) -> SizedCall | SlicedCall | None:
    """The ``SizedCall`` (``SlicedCall`` for slicing) of a ``SIZED_CALLS`` call, or None where its
    sizes are not plain ints (a dtype view, symbolic sizes, a split into listed sections, an index
    with tensors in it)."""
    if func in _SLICES:
        return sliced_call(func, args, kwargs)
    if func in _SPLITS:
        names = ("tensor" if func is torch.split else "self", "split_size_or_sections", "dim")
        values = dict(zip(names, args))
        values.update(kwargs)
        tensor, size = values.get(names[0], values.get("input")), values.get("split_size_or_sections", values.get("split_size"))
        if not isinstance(tensor, torch.Tensor) or type(size) is not int:
            return None
        return SizedCall(tensor, (size,), func, values.get("dim", 0) % max(tensor.ndim, 1))
    if func is torch.reshape:
        tensor = args[0] if args else kwargs.get("input")
        rest = args[1:] or (kwargs.get("shape"),)
    else:
        tensor, rest = args[0], args[1:] or (kwargs.get("size", kwargs.get("shape")),)
    if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        rest = tuple(rest[0])
    if not isinstance(tensor, torch.Tensor) or not all(type(s) is int for s in rest):
        return None
    return SizedCall(tensor, tuple(rest), func)


@dataclass(frozen=True)
class SlicedCall:
    """A slicing call: basic indexing ``x[...]`` with step-1 slices (``sizes``: start, stop per slice,
    None where the index leaves them out) or ``narrow`` (``sizes``: start, length); ``dims``: the
    tensor dim of each slice; ``rebuild``: the call again with other bounds."""

    tensor: torch.Tensor
    sizes: tuple
    dims: tuple
    rebuild: Callable
    narrow: bool = False

    def run(self, sizes: tuple) -> Any:
        return self.rebuild(sizes)

    def slices(self) -> Iterator[tuple[int, int | None, int | None]]:
        """(dim, start, stop) per slice, as ``aten.slice`` takes them."""
        if self.narrow:
            start, length = self.sizes
            yield self.dims[0], start, (start + length if start >= 0 or start + length < 0 else None)
            return
        for j, dim in enumerate(self.dims):
            yield dim, self.sizes[2 * j], self.sizes[2 * j + 1]


def _index_dims(index: tuple, ndim: int) -> list | None:
    """The tensor dim each element of a basic index addresses (None for ``None`` and ``...``), or
    None where the index is not basic (tensors, lists, bools)."""
    consumed = [e for e in index if e is not None and e is not Ellipsis]
    if any(isinstance(e, bool) or not isinstance(e, (slice, int)) for e in consumed) or sum(e is Ellipsis for e in index) > 1:
        return None
    dims: list = []
    d = 0
    for i, e in enumerate(index):
        if e is Ellipsis:
            d = ndim - sum(x is not None and x is not Ellipsis for x in index[i + 1:])
            dims.append(None)
        elif e is None:
            dims.append(None)
        else:
            dims.append(d)
            d += 1
    return dims


def sliced_call(func: Callable[..., Any], args: tuple, kwargs: dict) -> SlicedCall | None:
    """The ``SlicedCall`` of ``x[index]`` with step-1 slices, or of ``narrow``; None otherwise."""
    if func is torch.Tensor.__getitem__:
        tensor, index = args[0], args[1]
        index = index if isinstance(index, tuple) else (index,)
        dims = _index_dims(index, tensor.ndim) if isinstance(tensor, torch.Tensor) else None
        if dims is None:
            return None
        where = [i for i, e in enumerate(index) if isinstance(e, slice) and e.step in (None, 1)
                 and all(v is None or type(v) is int for v in (e.start, e.stop))]
        if not where:
            return None

        def rebuild(bounds: tuple, tensor: torch.Tensor = tensor, index: tuple = index, where: list[int] = where) -> Any:
            new = list(index)
            for j, i in enumerate(where):
                new[i] = slice(bounds[2 * j], bounds[2 * j + 1], index[i].step)
            return func(tensor, tuple(new))

        bounds = tuple(v for i in where for v in (index[i].start, index[i].stop))
        return SlicedCall(tensor, bounds, tuple(dims[i] for i in where), rebuild)
    names = ("input" if func is torch.narrow else "self", "dim", "start", "length")
    values = dict(zip(names, args))
    values.update(kwargs)
    tensor, dim, start, length = (values.get(n) for n in names)
    if not isinstance(tensor, torch.Tensor) or not all(type(v) is int for v in (dim, start, length)) or not tensor.ndim:
        return None
    return SlicedCall(tensor, (start, length), (dim % tensor.ndim,),
                      lambda bounds, tensor=tensor, dim=dim: func(tensor, dim, bounds[0], bounds[1]), narrow=True)


def _local_slice_bounds(call: SlicedCall) -> tuple | None:
    """The bounds a slicing call takes on the local shards where DTensor cuts its slices from an
    interleaved dim on the local shard (``vescale.dispatch.fast.interleaved``: whole sections stay local),
    written as the call writes them; None where it cuts none that way."""
    from ..dispatch.fast.interleaved import local_bounds, slice_sections
    from ..placement import interleave_of

    spec, out = call.tensor._spec, list(call.sizes)
    changed = False
    for j, (dim, start, stop) in enumerate(call.slices()):
        found = slice_sections(spec, dim, start, stop, 1)
        if found is None:
            continue
        m, first, count = found
        lo, hi = local_bounds(spec, m, dim, first, count, spec.shape[dim] // interleave_of(spec.placements[m]))
        if call.narrow:
            out = [lo, hi - lo]
        else:
            out[2 * j] = None if start is None else lo
            out[2 * j + 1] = None if stop is None else hi
        changed = True
    return tuple(out) if changed else None


def _whole_share(size: int, global_size: int) -> bool:
    """Whether ``size`` is a whole share of ``global_size`` (``global_size`` split evenly over some
    ranks): a size read from the local shard of another tensor, split over fewer ranks than the one
    sized by it. HF Mixtral's MoE block reads its batch from its DP-split input and reshapes by it an
    output that expert parallelism split over DP x EP. The inputs' global sizes are the recording's
    (else the step records or derives a record), so the model meant the global size there."""
    return 0 < size < global_size and global_size % size == 0


@dataclass(frozen=True)
class SizeRewrite:
    """A recorded call's sizes: at ``positions`` the model passes ``global_sizes``; the local shards
    take ``local_sizes`` there."""

    ndim: int
    positions: tuple
    global_sizes: tuple
    local_sizes: tuple

    def local(self, sizes: tuple, module: str, func: Callable[..., Any], derived: bool, scale: bool = False) -> tuple | None:
        """``sizes`` with the rewritten positions local, or None where the call passes the local sizes
        already (read from the local tensor); raises where the call is not the recorded one.
        ``derived``: the record was derived for new input sizes; ``scale``: from a record whose first
        static step kept this rewrite (the call passed the global size there, so a size that
        changed is a global one too)."""
        if len(sizes) == self.ndim and all(sizes[i] == n for i, n in zip(self.positions, self.local_sizes)):
            return None
        if scale and len(sizes) == self.ndim:
            scaled = self._scaled(sizes)
            if scaled is not None:
                return scaled
        if len(sizes) != self.ndim or not all(sizes[i] == g or (not derived and _whole_share(sizes[i], g))
                                              for i, g in zip(self.positions, self.global_sizes)):
            want = ["*"] * self.ndim
            for i, g in zip(self.positions, self.global_sizes):
                want[i] = g
            message = (
                f"module {module!r}: {func.__name__}{sizes} in a static step, where the recording saw "
                f"{func.__name__}({', '.join(map(str, want))}) with a global size (the local shards take "
                f"{self.local_sizes} at positions {self.positions})"
            )
            if derived:
                raise ResizeMismatch(f"{message}: a size there follows the inputs' sizes; the step records instead (run it again)")
            raise PlanError(f"{message}: the module must reshape the same way every step, or stay on DTensors with plan.eager({module!r})")
        out = list(sizes)
        for i, n in zip(self.positions, self.local_sizes):
            out[i] = n
        return tuple(out)


    def without_local(self, sizes: tuple) -> "SizeRewrite":
        """This rewrite less the positions where a static step's call passes the local size already:
        a size the model reads from the tensor (a batch that DP splits) beside one from its config
        (HF ``Conv1D``'s ``view(*x.size()[:-1], nf)`` with a column-parallel weight) in one call. Only
        the config's sizes are rewritten then, in this step and every later one."""
        if len(sizes) != self.ndim:
            return self
        keep = [j for j, (i, n) in enumerate(zip(self.positions, self.local_sizes)) if sizes[i] != n]
        if len(keep) == len(self.positions):
            return self
        pick = lambda values: tuple(values[j] for j in keep)  # noqa: E731
        return SizeRewrite(self.ndim, pick(self.positions), pick(self.global_sizes), pick(self.local_sizes))

    def _scaled(self, sizes: tuple) -> tuple | None:
        """In a record derived for new input sizes: the local sizes where each rewritten size is the
        recorded global one or follows the inputs (a global sequence length), split evenly over the
        ranks that split it when recorded (``global / local`` of them); None where one is not."""
        out = list(sizes)
        for i, g, n in zip(self.positions, self.global_sizes, self.local_sizes):
            if sizes[i] == g:
                out[i] = n
            elif n > 0 and g % n == 0 and sizes[i] > 0 and sizes[i] % (g // n) == 0:
                out[i] = sizes[i] // (g // n)
            else:
                return None
        return tuple(out)


@dataclass
class GlobalSizes:
    """A recorded call on a plain tensor, the global tensor (the same on every rank): the sizes it
    passed. A static body may pass a size it computes from a local shard where the recording read
    the global one from the DTensor: HF's mask code expands the position ids to the batch size of
    the embeddings, this DP rank's share in static steps. Such a call gets the recorded sizes, so
    the plain tensor is the recording's (and eager mode's) again.

    The first static step tells (``local``): the same sizes, and the note is dropped; sizes that
    differ only where each is a whole share of the recorded one (a size read from a split dim), and
    those positions are learnt (``positions`` / ``local_sizes``) and rewritten every step; anything
    else raises, naming the module. In a record derived for new input sizes, a learnt position that
    follows the inputs scales as ``SizeRewrite._scaled`` does, the other way round."""

    sizes: tuple
    positions: tuple = ()
    local_sizes: tuple = ()

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def global_sizes(self) -> tuple:
        return tuple(self.sizes[i] for i in self.positions)

    def local(self, sizes: tuple, module: str, func: Callable[..., Any], derived: bool, scale: bool = False) -> tuple | None:
        """The sizes the call takes (the recorded global ones where it passes local ones), or None
        where it passes the recorded sizes (nothing to rewrite, ever); raises where the call is not
        the recorded one. ``derived`` / ``scale``: as for ``SizeRewrite.local``."""
        if tuple(sizes) == self.sizes and not self.positions:
            return None
        if derived and not self.positions:
            # No static step has run this call: as before the rewrites, the derived record's first
            # step checks its local shapes (resize.checked_before).
            return tuple(sizes)
        if len(sizes) == self.ndim:
            if not self.positions and not derived:
                self._learn(sizes)
            out = self._global(sizes, scale)
            if out is not None:
                return out
        message = (f"module {module!r}: {func.__name__}{tuple(sizes)} on a plain tensor in a static step, where the recording "
                   f"passed {func.__name__}{self.sizes}")
        if derived:
            raise ResizeMismatch(f"{message}: a size there follows the inputs' sizes; the step records instead (run it again)")
        raise PlanError(f"{message}: the module must size its plain tensors the same way every step, or stay on DTensors "
                        f"with plan.eager({module!r})")

    def _learn(self, sizes: tuple) -> None:
        positions = tuple(i for i, (s, g) in enumerate(zip(sizes, self.sizes)) if s != g)
        if all(_whole_share(sizes[i], self.sizes[i]) for i in positions):
            self.positions, self.local_sizes = positions, tuple(sizes[i] for i in positions)

    def _global(self, sizes: tuple, scale: bool) -> tuple | None:
        if not self.positions:
            return None
        out = list(sizes)
        for i, g, n in zip(self.positions, self.global_sizes, self.local_sizes):
            if sizes[i] == n:
                out[i] = g
            elif scale and sizes[i] > 0:
                out[i] = sizes[i] * (g // n)  # a share of a global size that follows the inputs
            else:
                return None
        rest = [i for i in range(self.ndim) if i not in self.positions]
        return tuple(out) if scale or all(sizes[i] == self.sizes[i] for i in rest) else None


def size_rewrite(call: SizedCall | SlicedCall, out: Any) -> SizeRewrite | GlobalSizes | None:
    """The recording's note for a sized call that gave ``out``: a ``SizeRewrite`` where an explicit
    size is global (differs from the one the local tensors take), ``GlobalSizes`` for a call on a
    plain tensor, else None."""
    if isinstance(call, SlicedCall):
        # A DTensor's whole sections of an interleaved dim are cut on the local shard with local
        # bounds; a plain tensor is sliced as it is (the global tensor, every step).
        local = _local_slice_bounds(call) if isinstance(call.tensor, DTensor) else None
        if local is None:
            return None
        positions = tuple(i for i, (g, n) in enumerate(zip(call.sizes, local)) if g != n)
        return SizeRewrite(len(local), positions, tuple(call.sizes[i] for i in positions), tuple(local[i] for i in positions))
    if not isinstance(call.tensor, DTensor):
        return GlobalSizes(tuple(call.sizes))
    if call.func is torch.Tensor.expand:
        # Not on DTensors: an expanded dim's gradient is a sum, whose layout in static steps (a share
        # of it) the recording does not see. The first static step's shape check names the module.
        return None
    local, sizes = call.local_sizes(out), call.sizes
    if local is None or len(local) != len(sizes):
        return None
    positions = tuple(i for i, s in enumerate(sizes) if s != -1 and s != local[i])
    if not positions:
        return None
    return SizeRewrite(len(sizes), positions, tuple(sizes[i] for i in positions), tuple(local[i] for i in positions))
