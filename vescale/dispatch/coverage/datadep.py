"""Data-dependent ops on DTensors, with single-device answers and stated placements.

PyTorch's DTensor decides an op's output placements from the inputs' metadata, running the op on
fake tensors to learn output shapes. Ops whose output *size* depends on the values (``nonzero``,
one-argument ``where``, boolean-mask indexing, ``bincount``, ``unique``) cannot be run that way and
had no rule at all, so MoE routing code (HF's ``eager`` experts kernel) failed on them. Others ran
but were wrong or refused: ``index_add_`` into a ``Shard(0)`` tensor relabelled its placements
without moving data (zeros where the other ranks' rows were), ``plain.index_add_(dtensor)`` was a
bare ``AssertionError``, and ``_grouped_mm`` in fp32 failed in its meta function (bf16 only there,
though the CPU kernel takes fp32).

What this module does (installed by ``vescale.dispatch.install()``, never at import):

* **Value-sized outputs** (``nonzero``, ``bincount``, ``_unique2``, ``unique_dim``,
  ``unique_consecutive``): the input is brought to ``Replicate`` (a Partial sum is reduced, shards
  gathered) and the op runs on the whole tensor; the output is ``Replicate``. DTensor's even-chunk
  sharding cannot describe an output whose per-rank sizes depend on the data, and these outputs are
  small index/count tensors that the code using them indexes with, so Replicate is the layout that
  keeps the following ops local.
* **Boolean-mask indexing** (``index.Tensor``, ``index_put``): each mask becomes the long indices of
  its ``nonzero`` (above), then DTensor's own integer-index rules run; backward (``index_put`` with
  the same mask) is rewritten the same way.
* **Accumulation into a tensor** (``index_add``/``index_add_``, ``scatter_add``/``scatter_add_``): the
  result keeps ``self``'s placements. Per mesh dim: ``self`` sharded on the indexed dim keeps the
  sources whose index falls in its rows (the others add zero into a clamped row); sharded on another
  dim, the source (and scatter's index) is sharded the same way; ``Replicate`` needs a replicated
  source; ``Partial`` adds the source on the first rank of that dim only. A plain ``self`` (the global
  tensor) with DTensor arguments adds their global values.
* **``_grouped_mm`` output metadata** for non-bf16 inputs, computed from the shapes (the meta function
  checks bf16, the real CPU kernel does not); DTensor's own ``_grouped_mm`` strategy then applies.
"""

from __future__ import annotations

import threading

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from vescale._torch import DTensorSpec, TensorMeta, redistribute_local_tensor, compute_local_shape_and_global_offset, PATCHES

from ..local import runs_locally_when, why_rule_not_local
from ..metas import contiguous_strides, grouped_mm_shape
from ..scope import DTensorRule, for_vescale_meshes, mesh_of_call

__all__ = ["install_datadep_handlers", "uninstall_datadep_handlers", "DATADEP_OPS"]

aten = torch.ops.aten
_LOCK = threading.Lock()


# ---------------------------------------------------------------------------------------------
# helpers on local tensors (handlers run below autograd: no DTensor autograd functions here)
# ---------------------------------------------------------------------------------------------


def _to(t: DTensor, placements) -> torch.Tensor:
    """``t``'s local tensor redistributed to ``placements`` (a tuple, one per mesh dim)."""
    placements = tuple(placements)
    if tuple(t.placements) == placements:
        return t._local_tensor
    target = DTensorSpec(t.device_mesh, placements, tensor_meta=t._spec.tensor_meta)
    return redistribute_local_tensor(t._local_tensor, t._spec, target)


def _full(x):
    """The global value of a DTensor as a local tensor (other values unchanged)."""
    if isinstance(x, DTensor):
        return _to(x, (Replicate(),) * x.device_mesh.ndim)
    return x


def _wrap(local: torch.Tensor, mesh, placements, global_shape=None) -> DTensor:
    shape = local.shape if global_shape is None else torch.Size(global_shape)
    stride = torch.empty(shape, device="meta").stride() if global_shape is not None else local.stride()
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)


def _map(fn, obj):
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(fn, o) for o in obj)
    if isinstance(obj, dict):
        return {k: _map(fn, v) for k, v in obj.items()}
    return fn(obj)


# ---------------------------------------------------------------------------------------------
# value-sized outputs
# ---------------------------------------------------------------------------------------------


@for_vescale_meshes
def _replicated(op, args, kwargs):
    """Run on the global values; every tensor output is Replicate on the inputs' mesh."""
    mesh = mesh_of_call(args, kwargs)
    out = op(*_map(_full, args), **_map(_full, kwargs))
    replicate = (Replicate(),) * mesh.ndim
    return _map(lambda o: _wrap(o, mesh, replicate) if isinstance(o, torch.Tensor) else o, out)


_REPLICATED_OPS = [
    aten.nonzero.default,
    aten.bincount.default,
    aten._unique2.default,
    aten._unique.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
]


# ---------------------------------------------------------------------------------------------
# boolean masks in indexing
# ---------------------------------------------------------------------------------------------


def _is_mask(i) -> bool:
    return isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)


def _long_indices(indices):
    """Boolean masks replaced by the long indices of their nonzero entries (one per masked dim)."""
    out = []
    for i in indices:
        if _is_mask(i):
            out += list(torch.ops.aten.nonzero.default(i).unbind(1))  # DTensor masks go through _replicated
        else:
            out.append(i)
    return out


@for_vescale_meshes
def _masked_index(op, args, kwargs):
    self, indices, *rest = args
    if any(_is_mask(i) for i in indices):
        indices = _long_indices(indices)
    return DTensorRule(op)(self, indices, *rest, **kwargs)


# ---------------------------------------------------------------------------------------------
# accumulation into a tensor: index_add, scatter_add
# ---------------------------------------------------------------------------------------------


def _check_index(index: torch.Tensor, size: int, what: str) -> None:
    if index.numel() and (index.min() < 0 or index.max() >= size):
        bad = index[(index < 0) | (index >= size)][0].item()
        raise IndexError(f"{what}: index {bad} is out of bounds for dimension of size {size}")


def _accumulate(op_name: str, self, dim: int, index, src, alpha=1, scatter: bool = False):
    """``self`` (in place) += the contributions of ``src`` at ``index`` along ``dim``; returns self.

    Works on the local shards of ``self`` in its own placements (see the module docstring)."""
    what = f"{op_name} into a DTensor with placements {tuple(self.placements)}"
    mesh, ndim = self.device_mesh, self.ndim
    dim = dim % max(ndim, 1)
    index_full = _full(index)
    _check_index(index_full, self.shape[dim] if ndim else 1, what)
    if not isinstance(src, torch.Tensor):
        src = torch.as_tensor(src, dtype=self.dtype)
    src_targets, index_targets, partial_dims = [], [], []
    for m, p in enumerate(self.placements):
        if isinstance(p, Shard) and p.dim != dim:
            if scatter and not (index.shape[p.dim] == src.shape[p.dim] == self.shape[p.dim]):
                raise NotImplementedError(
                    f"{what}: index/src cover only part of sharded dim {p.dim}; redistribute self to "
                    f"Replicate on mesh dim {m} first (self.redistribute(...))"
                )
            src_targets.append(Shard(p.dim))
            index_targets.append(Shard(p.dim) if scatter else Replicate())
        else:
            src_targets.append(Replicate())
            index_targets.append(Replicate())
            if isinstance(p, Partial):
                if p.reduce_op != "sum":
                    raise NotImplementedError(f"{what}: only Partial(sum) can accumulate; reduce self first")
                partial_dims.append(m)
    src_local = _to(src, src_targets) if isinstance(src, DTensor) else _slice(src, mesh, src_targets)
    index_local = _to(index, index_targets) if isinstance(index, DTensor) else _slice(index, mesh, index_targets)
    coord = mesh.get_coordinate()
    if any(coord[m] != 0 for m in partial_dims):
        src_local = torch.zeros_like(src_local)  # a Partial sum gets the addend once, on its first rank
    local_shape, offset = compute_local_shape_and_global_offset(self.shape, mesh, self.placements)
    if ndim and (local_shape[dim] != self.shape[dim]):
        # Sharded on the indexed dim: keep the contributions to this rank's rows; the others add
        # zero into a clamped row (shapes stay as they are, so scatter's index/src stay aligned).
        lo, n = offset[dim], local_shape[dim]
        mine = (index_local >= lo) & (index_local < lo + n)
        index_local = torch.where(mine, index_local - lo, 0)
        if n == 0:
            return self  # an empty shard receives nothing
        keep = mine.view([-1 if d == dim else 1 for d in range(src_local.ndim)]) if not scatter and src_local.ndim else mine
        src_local = torch.where(keep, src_local, torch.zeros((), dtype=src_local.dtype))
    target = self._local_tensor
    if scatter:
        target.scatter_add_(dim, index_local, src_local.to(target.dtype))
    else:
        target.index_add_(dim, index_local, src_local.to(target.dtype), alpha=alpha)
    return self


def _slice(t: torch.Tensor, mesh, placements) -> torch.Tensor:
    """A plain (global) tensor's local piece under ``placements`` (Replicate or Shard only)."""
    if all(isinstance(p, Replicate) for p in placements):
        return t
    spec = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tensor_meta=TensorMeta(t.shape, t.stride(), t.dtype))
    return redistribute_local_tensor(t, spec, DTensorSpec(mesh, tuple(placements), tensor_meta=spec.tensor_meta))


@for_vescale_meshes
def _index_add(op, args, kwargs):
    self, dim, index, source = args[:4]
    alpha = args[4] if len(args) > 4 else kwargs.get("alpha", 1)
    inplace = op is aten.index_add_.default
    return _accumulate_op(op, "index_add_" if inplace else "index_add", self, dim, index, source, alpha, False, inplace)


@for_vescale_meshes
def _scatter_add(op, args, kwargs):
    self, dim, index, src = args[:4]
    inplace = op is aten.scatter_add_.default
    return _accumulate_op(op, "scatter_add_" if inplace else "scatter_add", self, dim, index, src, 1, True, inplace)


def _accumulate_op(op, name, self, dim, index, src, alpha, scatter, inplace):
    if not isinstance(self, DTensor):
        # A plain tensor is the global tensor: add the DTensor arguments' global values into it.
        # Autograd gives a DTensor source a plain gradient here (the global value); flowing on into
        # DTensor ops it meets them as Replicate, which is right (HF's eager kernel on unplanned
        # inputs does exactly this), but a DTensor *leaf* would keep a plain .grad.
        target = self if inplace else self.clone()
        fn = target.scatter_add_ if scatter else target.index_add_
        extra = {} if scatter else {"alpha": alpha}
        fn(dim, _full(index), _full(src), **extra)
        return target
    if not inplace:
        # out of place: a copy laid out like self (DTensor's clone keeps placements)
        self = DTensor(self._local_tensor.clone(), self._spec, requires_grad=False)
    return _accumulate(name, self, dim, index, src, alpha, scatter)


_ACCUMULATE_OPS = {
    aten.index_add_.default: _index_add,
    aten.index_add.default: _index_add,
    aten.scatter_add_.default: _scatter_add,
    aten.scatter_add.default: _scatter_add,
}


# ---------------------------------------------------------------------------------------------
# _grouped_mm output metadata
# ---------------------------------------------------------------------------------------------


def _grouped_mm_meta(op_schema) -> TensorMeta | None:
    """Output TensorMeta of ``_grouped_mm`` from the shapes (its meta function insists on bf16)."""
    a = op_schema.args_schema[0]
    if not isinstance(a, DTensorSpec) or a.tensor_meta.dtype == torch.bfloat16:
        return None
    shape = grouped_mm_shape(op_schema)
    if shape is None:
        return None
    dtype = op_schema.kwargs_schema.get("out_dtype") or a.tensor_meta.dtype
    return TensorMeta(torch.Size(shape), contiguous_strides(shape), dtype)


class _GroupedMMMetadata:
    """Replaces the propagator's ``_propagate_tensor_meta_non_cached`` (an instance attribute):
    ``_grouped_mm`` metadata from shapes, which PyTorch's FakeTensor run cannot give for fp32 (its
    meta function insists on bf16); every other op goes to PyTorch's step. Op coverage; the fast
    path's metadata (``cache._FastOutputMetadata``) sits in front of it."""

    def __init__(self, propagator):
        self.fallback = type(propagator)._propagate_tensor_meta_non_cached.__get__(propagator)

    def __call__(self, op_schema):
        if op_schema.op is aten._grouped_mm.default:
            meta = _grouped_mm_meta(op_schema)
            if meta is not None:
                return meta
        return self.fallback(op_schema)


# ---------------------------------------------------------------------------------------------
# installation
# ---------------------------------------------------------------------------------------------

_HANDLERS = {
    **{op: _replicated for op in _REPLICATED_OPS},
    aten.index.Tensor: _masked_index,
    aten.index_put.default: _masked_index,
    aten.index_put_.default: _masked_index,
    aten._index_put_impl_.default: _masked_index,
    **_ACCUMULATE_OPS,
}
DATADEP_OPS = tuple(_HANDLERS) + (aten._grouped_mm.default,)


def _runs_locally(op, args, kwargs) -> bool:
    """For Static Eager mode: every DTensor argument is Replicate on each mesh dim with more than
    one rank, so the op on the local tensors is the op on the global ones (and its output is
    Replicate, as the handler makes it). MoE routing under tensor parallelism is such a case."""
    found: list = []
    _map(lambda x: found.append(x) if isinstance(x, DTensor) else None, (args, kwargs))
    return all(
        p.is_replicate() or t.device_mesh.size(i) == 1 for t in found for i, p in enumerate(t.placements)
    )


def _index_runs_locally(op, args, kwargs) -> bool:
    """Indexing without boolean masks is DTensor's own rule (the handler only rewrites masks): local
    when that rule moves nothing (e.g. rows of a Partial sum picked by replicated indices)."""
    if any(_is_mask(i) for i in args[1]):
        return _runs_locally(op, args, kwargs)
    return why_rule_not_local(op, args, kwargs) is None


for _handler in set(_HANDLERS.values()):
    runs_locally_when(_handler, _index_runs_locally if _handler is _masked_index else _runs_locally)
_OWNER = "dispatch.coverage.datadep"


def install_datadep_handlers() -> None:
    """Register the handlers in DTensor's per-op table and the ``_grouped_mm`` metadata (idempotent)."""
    if PATCHES.owners(_OWNER):
        return
    prop = DTensor._op_dispatcher.sharding_propagator
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op, handler in _HANDLERS.items():
        PATCHES.set_item(_OWNER, handlers, op, handler, f"DTensor custom handler {op}")
    PATCHES.set_attr(_OWNER, prop, "_propagate_tensor_meta_non_cached", _GroupedMMMetadata(prop))


def uninstall_datadep_handlers() -> None:
    PATCHES.undo(_OWNER)


