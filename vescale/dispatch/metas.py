"""Output metadata (shape, stride, dtype) of an op on DTensor specs, without a FakeTensor run.

DTensor learns what an op returns by running it under ``FakeTensorMode`` (~0.5-1.5 ms a call). The
shape-free cache (``cache.py``) and the cheap search (``search.py``) need the same answer far more
often, on every hit of a new sequence length, so they take it from here:

* ``meta_outputs``: the op's own meta kernel on meta-device tensors (any op that has one);
* ``fast_outputs``: arithmetic for the op kinds a transformer step is made of, only where the result
  is certain from the input metadata: elementwise ops whose operands agree on one order of the dims
  (see ``_elementwise``), sum / mean over dims of a contiguous input, ``mm``/``bmm`` (always a fresh
  contiguous tensor), views and reshapes of contiguous tensors, ``expand``, ``slice``, ``split``,
  ``unsqueeze``, ``transpose``/``t`` (sizes and strides moved), ``detach``/``alias``, ``clone``
  (of a contiguous input, or to contiguous format), ``new_*`` and ``slice_backward`` (fresh at their
  size), the softmax / NLL-loss kernels of contiguous inputs, and the router's and MoE dispatch's
  fresh allocations: ``topk``, ``sort`` and ``index_put`` / ``empty_like`` of a contiguous input,
  ``histc``, ``embedding_dense_backward``, ``_grouped_mm`` (CPU builds), a row gather ``x[idx]`` of a contiguous ``x``, ``cat``
  whose first input suggests the contiguous format. Anything else returns None and the caller runs the meta
  kernel. Output dtypes are not derived: callers pass the dtype(s) PyTorch gave for the same op,
  input dtypes and scalar arguments (promotion depends only on those, which cache keys keep, a
  Python scalar with its type);
* ``kernel_outputs``: ``meta_outputs`` for PyTorch's own miss path, where FakeTensor would run the
  same Meta kernel (the FakeTensor run costs 2-5 ms a first call; the meta call a fraction);
* ``miss_outputs``: the same for PyTorch's own miss path where the dtype needs no learned answer
  (``mm``/``bmm`` of one dtype, ``embedding``), in place of its FakeTensor run.

The meta kernels of elementwise and loss ops are Python references in PyTorch 2.13 (0.3-2 ms each on
this project's CI machine), which made a cache hit cost nearly as much as the miss it replaced.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from vescale._torch import fake_mode_runs_meta_kernel, local_tensor_mode, DTensorSpec, TensorMeta, OpSchema
from torch.distributed.tensor import Partial, Replicate, Shard


if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import Placement

__all__ = ["meta_outputs", "kernel_outputs", "fast_outputs", "miss_outputs", "contiguous_strides", "grouped_mm_shape", "with_meta", "spec_of", "mesh_shape",
           "local_shape"]

_MESH_SHAPES: dict = {}  # id(mesh) -> (mesh, mesh.shape)


def mesh_shape(mesh: DeviceMesh) -> tuple:
    """``mesh.shape``, remembered per mesh object (DeviceMesh builds the tuple from its layout on
    every call, a few microseconds; the shape-free cache's keys ask for it per tensor)."""
    found = _MESH_SHAPES.get(id(mesh))
    if found is None or found[0] is not mesh:
        found = _MESH_SHAPES[id(mesh)] = (mesh, mesh.shape)
    return found[1]


aten = torch.ops.aten


def with_meta(spec: DTensorSpec, meta: TensorMeta | None, mesh: DeviceMesh | None = None) -> DTensorSpec:
    """``spec`` with other metadata (and, given, another mesh object): what ``DTensorSpec(mesh,
    spec.placements, tensor_meta=meta, use_strided_shard_as_shard_order=...)`` builds, without the
    constructor. The constructor derives the shard order from the placements and the flag alone
    (~10-15 us a spec), so a copy of a constructor-made spec's fields is that spec. The mesh is
    always the caller's: DeviceMesh equality ignores the rank that built it, so a mesh learned on
    another (simulated) rank compares equal but holds other coordinates."""
    new = object.__new__(DTensorSpec)
    new.__dict__.update(spec.__dict__)
    new.__dict__.update(mesh=spec.mesh if mesh is None else mesh, tensor_meta=meta, _hash=None)
    return new


def local_shape(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]) -> tuple | None:
    """This rank's shard shape of a tensor of global ``shape`` laid out as ``placements`` on
    ``mesh``: DTensor's ``compute_local_shape_and_global_offset`` by arithmetic (``torch.chunk``'s
    sizes, uneven shards included) where every placement is a plain ``Shard``, ``Replicate`` or
    ``Partial`` and no tensor dim is split by two mesh dims (no shard order to follow); None
    otherwise, under ``LocalTensorMode`` (coordinates per simulated rank), or off the mesh."""
    coordinate = mesh.get_coordinate()
    if coordinate is None or local_tensor_mode() is not None:
        return None
    local = list(shape)
    seen = set()
    for n, c, p in zip(mesh_shape(mesh), coordinate, placements):
        kind = type(p)
        if kind is Shard:
            d = p.dim
            if d in seen or not 0 <= d < len(local):
                return None
            seen.add(d)
            size = local[d]
            full = -(-size // n)  # the chunk size every rank but the last ones gets
            start = full * c
            local[d] = 0 if size < start else min(size, start + full) - start
        elif kind is not Replicate and kind is not Partial:
            return None
    return tuple(local)


_TEMPLATES: dict = {}  # (mesh, placements) -> a constructor-made spec without metadata


def spec_of(mesh: DeviceMesh, placements: tuple, meta: TensorMeta | None) -> DTensorSpec:
    """``DTensorSpec(mesh, placements, tensor_meta=meta)``, built once per mesh and placements and
    copied (``with_meta``) after that."""
    key = (mesh, placements)
    template = _TEMPLATES.get(key)
    if template is None:
        if len(_TEMPLATES) >= 4096:  # placements are few; a bound for programs that make many meshes
            _TEMPLATES.clear()
        template = _TEMPLATES[key] = DTensorSpec(mesh, placements)
    return with_meta(template, meta, mesh)


def _is_elementwise(op) -> bool:
    """PyTorch's own mark for TensorIterator elementwise ops (DTensor's pointwise rules use it too);
    in-place and out= variants excluded (their output is an argument, laid out as it is)."""
    schema = op._schema
    return (torch.Tag.pointwise in op.tags and not schema.is_mutable
            and not any(a.is_out for a in schema.arguments))


def _is_in_place_elementwise(op) -> bool:
    """An in-place TensorIterator op (``div_``, ``mul_``): pointwise, writing its first argument,
    which it returns."""
    schema = op._schema
    args = schema.arguments
    return (torch.Tag.pointwise in op.tags and op._opname.endswith("_") and len(schema.returns) == 1
            and bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write
            and not any(a.is_out for a in args))


def _meta_of(x):
    if isinstance(x, torch.Tensor):
        return TensorMeta(shape=x.shape, stride=x.stride(), dtype=x.dtype)
    if isinstance(x, (tuple, list)):
        return type(x)(_meta_of(i) for i in x)
    return None


def _on_meta(a):
    """A meta-device tensor for every DTensorSpec in ``a`` (lists and tuples walked; a plain loop:
    pytree's tree_map cost more than the meta kernels it fed)."""
    if isinstance(a, DTensorSpec):
        m = a.tensor_meta
        return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")
    if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        return type(a)(_on_meta(x) for x in a)
    return a


def meta_outputs(op_schema: OpSchema) -> TensorMeta | Sequence[Any] | None:
    """Output TensorMeta(s) from the op's meta kernel, or None when it has none."""
    try:
        args = tuple(_on_meta(a) for a in op_schema.args_schema)
        kwargs = {k: _on_meta(v) for k, v in op_schema.kwargs_schema.items()}
        return _meta_of(op_schema.op(*args, **kwargs))
    except Exception:  # no meta kernel, data-dependent output, ...: PyTorch's path decides
        return None


def kernel_outputs(op_schema: OpSchema) -> TensorMeta | Sequence[Any] | None:
    """PyTorch's miss path's answer without its FakeTensor run: the op's Meta kernel on meta-device
    tensors, where ``FakeTensorMode`` would run that same kernel (``_torch.fake_mode_runs_meta_kernel``),
    the sizes are plain integers, no argument names a device (a meta call would allocate there) and
    no dispatch mode is active (one that traces or counts ops must not see these calls). None
    otherwise: PyTorch's FakeTensor run decides. A 4-rank tiny LLaMA's first step answers ~60 of its
    ~90 misses this way (0.47-0.72 -> 0.42-0.50 s of CPU per rank)."""
    if not fake_mode_runs_meta_kernel(op_schema.op) or torch._C._len_torch_dispatch_stack() > 0:
        return None
    for arg in (*op_schema.args_schema, *op_schema.kwargs_schema.values()):
        if isinstance(arg, torch.device):
            return None
        specs = arg if isinstance(arg, (list, tuple)) else (arg,)
        for spec in specs:
            if isinstance(spec, DTensorSpec) and not all(type(n) is int for n in spec.tensor_meta.shape):
                return None
    return meta_outputs(op_schema)


def contiguous_strides(shape: Sequence[int]) -> tuple:
    """Row-major strides of ``shape``, as ``torch.empty(shape).stride()`` gives them (size-0 and
    size-1 dims count as 1, like PyTorch's ``make_contiguous_strides_for``, which costs ~30 us)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n if n > 1 else 1
    return tuple(reversed(strides))


def _contiguous(meta: TensorMeta) -> bool:
    return tuple(meta.stride) == contiguous_strides(meta.shape)


def _shared_contiguous_strides(metas) -> tuple | None:
    """The operands' strides where every one has the first one's shape and its canonical
    contiguous strides; else None."""
    shape, stride = metas[0].shape, tuple(metas[0].stride)
    if stride != contiguous_strides(shape):
        return None
    for m in metas[1:]:
        if m.shape != shape or tuple(m.stride) != stride:
            return None
    return stride


def _row_major(meta: TensorMeta) -> bool:
    """Strides that fall strictly from each dim of size > 1 to the next, broadcast (stride-0) dims
    left out: TensorIterator and the Python reference order such an operand's dims as they are
    (dims of size 1 or stride 0 decide nothing), so it asks for a row-major output. Canonical
    contiguous strides are such; so are a column slice's ``(128, 1)`` of a ``(576, 64)`` tensor and
    an expanded ``(72, 1, 0)``."""
    last = None
    for n, st in zip(meta.shape, meta.stride):
        if n < 2 or st == 0:
            continue
        if last is not None and st >= last:
            return False
        last = st
    return True


def _broadcast(shapes) -> tuple | None:
    rank = max(len(s) for s in shapes)
    out = [1] * rank
    for s in shapes:
        for i, n in enumerate(s, rank - len(s)):
            if n != 1:
                if out[i] != 1 and out[i] != n:
                    return None
                out[i] = n
    return tuple(out)


def _tensor_metas(op_schema: OpSchema) -> list | None:
    """TensorMeta of every tensor argument, or None if one sits in a list (foreach ops) or a kwarg."""
    if any(isinstance(v, (DTensorSpec, list, tuple)) for v in op_schema.kwargs_schema.values()):
        return None
    metas = []
    for a in op_schema.args_schema:
        if isinstance(a, DTensorSpec):
            metas.append(a.tensor_meta)
        elif isinstance(a, (list, tuple)) and any(isinstance(x, (DTensorSpec, torch.Tensor)) for x in a):
            return None
        elif isinstance(a, torch.Tensor):
            return None
    return metas


def _elementwise(op_schema: OpSchema, dtype):
    """An out-of-place elementwise op's output, where every path PyTorch may take to it (the C++
    TensorIterator meta, the Python reference's ``compute_elementwise_output_strides``, FakeTensor's
    fast elementwise impl) agrees. Size-1 output dims are where those paths differ in general, so
    such an output is answered only when every tensor input has exactly its shape with canonical
    contiguous strides (TensorIterator's contiguous fast setup; RMSNorm's ``(batch, seq, 1)``
    statistics). Otherwise the operands must agree on one order of the dims: all row-major
    (``_row_major``: contiguous, a column slice, an expanded tensor) give a contiguous output,
    all along another order (``_agreed_order``) an output dense in it. Anything else: None, and
    the caller runs the meta kernel."""
    metas = _tensor_metas(op_schema)
    if not metas:
        return None
    shape = metas[0].shape
    strides = None if 0 in shape else _shared_contiguous_strides(metas)
    if strides is not None:  # operands of one shape, all contiguous (most calls): every branch below gives this
        return TensorMeta(shape if type(shape) is torch.Size else torch.Size(shape), strides, dtype)
    shape = _broadcast([m.shape for m in metas])
    if shape is None or 0 in shape:
        return None
    if 1 in shape:
        same = all(tuple(m.shape) == shape and _contiguous(m) for m in metas)
        return TensorMeta(torch.Size(shape), contiguous_strides(shape), dtype) if same else None
    if all(_row_major(m) for m in metas):
        return TensorMeta(torch.Size(shape), contiguous_strides(shape), dtype)
    order = _agreed_order(metas, shape)
    if order is None:
        return None
    stride, step = [0] * len(shape), 1
    for d in reversed(order):
        stride[d], step = step, step * shape[d]
    return TensorMeta(torch.Size(shape), tuple(stride), dtype)


def _agreed_order(metas, shape) -> list | None:
    """The output's dims from outermost to innermost where the first operand has the output's shape
    and distinct non-zero strides (its order), or every operand orders them alike: one operand of
    the output's shape has distinct non-zero strides (it decides every pair of dims), and each
    operand's non-zero strides (broadcast dims have none) fall along that order. Then
    TensorIterator's dim sort and the Python reference's both give that order, and the output is
    dense in it (a heads-first view times the broadcast rotary cos: the view's layout)."""
    def decides(m: TensorMeta) -> bool:
        return tuple(m.shape) == shape and 0 not in m.stride and len(set(m.stride)) == len(shape)

    if decides(metas[0]):
        # The first operand decides every pair of dims before any other is asked (both sorts go
        # through the operands in order and return at the first strict stride comparison), so the
        # others need not agree: the rotary ``q * cos + rotate_half(q) * sin`` of a heads-first
        # view and a contiguous ``cat``.
        return sorted(range(len(shape)), key=lambda d: -metas[0].stride[d])
    full = next((m for m in metas if decides(m)), None)
    if full is None:
        return None
    order = sorted(range(len(shape)), key=lambda d: -full.stride[d])
    for m in metas:
        lead = len(shape) - len(m.shape)
        strides = [m.stride[d - lead] for d in order if d >= lead and m.shape[d - lead] > 1 and m.stride[d - lead] != 0]
        if any(a <= b for a, b in zip(strides, strides[1:])):
            return None
    return order


def _fresh(shape, dtype) -> TensorMeta:
    return TensorMeta(torch.Size(shape), contiguous_strides(shape), dtype)


def _matmul(op_schema: OpSchema, dtype):
    a, b = op_schema.args_schema[0].tensor_meta, op_schema.args_schema[1].tensor_meta
    if op_schema.op is aten.mm.default and len(a.shape) == 2 and len(b.shape) == 2 and a.shape[1] == b.shape[0]:
        return _fresh((a.shape[0], b.shape[1]), dtype)
    if (op_schema.op is aten.bmm.default and len(a.shape) == 3 and len(b.shape) == 3
            and a.shape[0] == b.shape[0] and a.shape[2] == b.shape[1]):
        return _fresh((a.shape[0], a.shape[1], b.shape[2]), dtype)
    return None


def _transpose(op_schema: OpSchema, dtype):
    m = op_schema.args_schema[0].tensor_meta
    ndim = len(m.shape)
    if op_schema.op is aten.t.default:
        if ndim < 2:
            return TensorMeta(m.shape, tuple(m.stride), dtype)
        d0, d1 = 0, 1
    else:
        d0, d1 = op_schema.args_schema[1], op_schema.args_schema[2]
        if not (-ndim <= d0 < ndim and -ndim <= d1 < ndim):
            return None
        d0, d1 = d0 % ndim, d1 % ndim
    shape, stride = list(m.shape), list(m.stride)
    shape[d0], shape[d1] = shape[d1], shape[d0]
    stride[d0], stride[d1] = stride[d1], stride[d0]
    return TensorMeta(torch.Size(shape), tuple(stride), dtype)


def _view(op_schema: OpSchema, dtype):
    """A view (or reshape) of a contiguous tensor is contiguous in its new shape (checked against
    the meta kernel on every factorisation of small shapes, size-1 dims included, in the tests);
    a view of any tensor as its own shape keeps its strides."""
    x, size = op_schema.args_schema[0].tensor_meta, op_schema.args_schema[1]
    if not isinstance(size, (list, tuple)):
        return None
    if tuple(size) == tuple(x.shape):  # a view as its own shape keeps every stride (computeStride)
        return TensorMeta(x.shape, tuple(x.stride), dtype)
    if not _contiguous(x):
        return None
    numel = 1
    for n in x.shape:
        numel *= n
    known, unknown = 1, [i for i, n in enumerate(size) if n == -1]
    for n in size:
        if n != -1:
            if n < 0:
                return None
            known *= n
    shape = list(size)
    if unknown:
        if len(unknown) > 1 or known == 0 or numel % known:
            return None
        shape[unknown[0]] = numel // known
    elif known != numel:
        return None
    return _fresh(shape, dtype)


def _expand(op_schema: OpSchema, dtype):
    """expand: new leading dims and size-1 dims that grow get stride 0, every other dim keeps its
    size and stride (``inferExpandGeometry``)."""
    x, size = op_schema.args_schema[0].tensor_meta, op_schema.args_schema[1]
    if len(op_schema.args_schema) > 2 or op_schema.kwargs_schema or len(size) < len(x.shape):
        return None
    lead = len(size) - len(x.shape)
    shape, stride = [], []
    for i, n in enumerate(size):
        if i < lead:
            if n < 0:
                return None
            shape.append(n), stride.append(0)
            continue
        have, have_stride = x.shape[i - lead], x.stride[i - lead]
        if n == -1 or n == have:
            shape.append(have), stride.append(have_stride)
        elif have == 1 and n >= 0:
            shape.append(n), stride.append(0)
        else:
            return None
    return TensorMeta(torch.Size(shape), tuple(stride), dtype)


def _slice(op_schema: OpSchema, dtype):
    """slice(dim, start, end, step) is a view: the dim's size is its clamped range's length over
    step and its stride times step (``at::native::slice``); other dims unchanged."""
    x = op_schema.args_schema[0].tensor_meta
    dim, start, end, step = (list(op_schema.args_schema[1:]) + [0, None, None, 1][len(op_schema.args_schema) - 1:])[:4]
    ndim = len(x.shape)
    if op_schema.kwargs_schema or ndim == 0 or not -ndim <= dim < ndim or step is None or step <= 0:
        return None
    dim %= ndim
    size = x.shape[dim]
    start = 0 if start is None else start
    end = size if end is None else end
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    shape, stride = list(x.shape), list(x.stride)
    shape[dim] = (end - start + step - 1) // step
    stride[dim] *= step
    return TensorMeta(torch.Size(shape), tuple(stride), dtype)


def _split(op_schema: OpSchema, dtypes):
    """split(x, size, dim): pieces of ``size`` (the last one shorter) along dim, each a view with
    x's strides (``at::native::split``)."""
    x, size = op_schema.args_schema[0].tensor_meta, op_schema.args_schema[1]
    dim = op_schema.args_schema[2] if len(op_schema.args_schema) > 2 else 0
    ndim = len(x.shape)
    if op_schema.kwargs_schema or not isinstance(size, int) or size <= 0 or not -ndim <= dim < ndim:
        return None
    dim %= ndim
    n = x.shape[dim]
    lengths = [size] * (n // size) + ([n % size] if n % size else [])
    if not lengths or len(lengths) != len(dtypes):
        return None
    pieces = []
    for length, dtype in zip(lengths, dtypes):
        shape = list(x.shape)
        shape[dim] = length
        pieces.append(TensorMeta(torch.Size(shape), tuple(x.stride), dtype))
    return pieces


def _same_as_first(op_schema: OpSchema, dtype):
    """detach / alias return a view with the input's sizes and strides; clone (preserve format) of a
    contiguous tensor and the softmax kernels of a contiguous input return a contiguous tensor."""
    m = op_schema.args_schema[0].tensor_meta
    if op_schema.op in (aten.detach.default, aten.alias.default):
        return TensorMeta(m.shape, tuple(m.stride), dtype)
    if op_schema.op is aten.clone.default and op_schema.kwargs_schema:
        return None  # an explicit memory_format
    if not all(_contiguous(x) for x in (_tensor_metas(op_schema) or [None]) if x is not None):
        return None
    return _fresh(m.shape, dtype)


def _sized_fresh(op_schema: OpSchema, dtype):
    """new_zeros / new_ones / new_empty (size at 1), new_full, slice_backward (input_sizes at 1):
    a tensor allocated at that size (``at::empty`` / ``at::zeros``), contiguous."""
    size = op_schema.args_schema[1]
    if not isinstance(size, (list, tuple)) or any(not isinstance(n, int) or n < 0 for n in size):
        return None
    return _fresh(size, dtype)


def _contiguous_clone(op_schema: OpSchema, dtype):
    """clone(memory_format=contiguous_format) (``.contiguous()``, ``.reshape`` of a strided view):
    contiguous whatever the input's layout; any other memory format: the meta kernel."""
    if op_schema.kwargs_schema.get("memory_format") is torch.contiguous_format and len(op_schema.kwargs_schema) == 1:
        return _fresh(op_schema.args_schema[0].tensor_meta.shape, dtype)
    return _same_as_first(op_schema, dtype)


def _unsqueeze(op_schema: OpSchema, dtype):
    """unsqueeze(dim) is a view: a size-1 dim inserted with stride size*stride of the dim it goes
    before, or 1 at the end (``inferUnsqueezeGeometry``)."""
    m, dim = op_schema.args_schema[0].tensor_meta, op_schema.args_schema[1]
    ndim = len(m.shape)
    if not -ndim - 1 <= dim <= ndim:
        return None
    dim %= ndim + 1
    shape, stride = list(m.shape), list(m.stride)
    stride.insert(dim, 1 if dim >= ndim else shape[dim] * stride[dim])
    shape.insert(dim, 1)
    return TensorMeta(torch.Size(shape), tuple(stride), dtype)


def _squeeze(op_schema: OpSchema, dtype):
    """squeeze(dim) is a view: the dim dropped with its stride where its size is 1, else the input
    as it is (``inferSqueezeGeometry``)."""
    m, dim = op_schema.args_schema[0].tensor_meta, op_schema.args_schema[1]
    ndim = len(m.shape)
    if not isinstance(dim, int) or not ndim or not -ndim <= dim < ndim:
        return None
    dim %= ndim
    if m.shape[dim] != 1:
        return TensorMeta(m.shape, tuple(m.stride), dtype)
    keep = [i for i in range(ndim) if i != dim]
    return TensorMeta(torch.Size(m.shape[i] for i in keep), tuple(m.stride[i] for i in keep), dtype)


def _in_place(op_schema: OpSchema, dtype):
    """An in-place elementwise op or ``index_put_`` returns ``self``: its sizes, strides and dtype."""
    m = op_schema.args_schema[0].tensor_meta
    return TensorMeta(m.shape, tuple(m.stride), m.dtype) if m.dtype == dtype else None


def _to_copy(op_schema: OpSchema, dtype):
    """``_to_copy`` (``.to(dtype)``, preserve format) of a contiguous tensor: contiguous."""
    m = op_schema.args_schema[0].tensor_meta
    fmt = op_schema.kwargs_schema.get("memory_format")
    if fmt not in (None, torch.preserve_format) or not _contiguous(m):
        return None
    return _fresh(m.shape, dtype)


def _constant_pad(op_schema: OpSchema, dtype):
    """``constant_pad_nd`` (F.pad; the causal-LM loss shifts its labels so) of a contiguous tensor
    the reference allocates with the input's suggested memory format: contiguous, each padded dim
    grown by its pair of pads (from the last dim backwards)."""
    m, pad = op_schema.args_schema[0].tensor_meta, op_schema.args_schema[1]
    if not isinstance(pad, (list, tuple)) or len(pad) % 2 or len(pad) // 2 > len(m.shape):
        return None
    if not _contiguous(m) or not _suggests_contiguous(m):
        return None
    shape = list(m.shape)
    for i in range(len(pad) // 2):
        shape[-1 - i] += pad[2 * i] + pad[2 * i + 1]
    return _fresh(shape, dtype) if min(shape, default=0) >= 0 else None


def _softmax_backward(op_schema: OpSchema, dtype):
    grad, out = op_schema.args_schema[0].tensor_meta, op_schema.args_schema[1].tensor_meta
    if not (_contiguous(grad) and _contiguous(out)) or tuple(grad.shape) != tuple(out.shape):
        return None
    return _fresh(grad.shape, dtype)


def _nll_loss_forward(op_schema: OpSchema, dtypes):
    """nll_loss_forward(self (N, C) or (C,), target, weight, reduction, ignore_index) ->
    (loss, total_weight): loss is (N,) without reduction, else a scalar; total_weight a scalar."""
    x, target, weight, reduction = op_schema.args_schema[:4]
    if not isinstance(target, DTensorSpec) or weight is not None or len(x.tensor_meta.shape) not in (1, 2):
        return None
    shape = (x.tensor_meta.shape[0],) if reduction == 0 and len(x.tensor_meta.shape) == 2 else ()
    return (_fresh(shape, dtypes[0]), _fresh((), dtypes[1]))


def _nll_loss_backward(op_schema: OpSchema, dtype):
    """nll_loss_backward returns a zero-filled gradient of self's shape (a fresh contiguous tensor)."""
    x = op_schema.args_schema[1].tensor_meta
    if len(x.shape) not in (1, 2) or op_schema.args_schema[3] is not None:
        return None
    return _fresh(x.shape, dtype)


def _reduction(op_schema: OpSchema, dtype):
    """sum / mean over dims (``dim=None``: all) of a canonical contiguous input: TensorIterator's
    reductions allocate their output without strides, so it is a fresh contiguous tensor of the
    reduced shape (size-1 dims kept with ``keepdim``)."""
    x, dims, keepdim = (*op_schema.args_schema, False)[:3]
    meta = x.tensor_meta
    if not _contiguous(meta) or not isinstance(keepdim, bool):
        return None
    ndim = len(meta.shape)
    reduced = set(range(ndim)) if dims is None or len(dims) == 0 else {d % ndim for d in dims} if ndim else set()
    shape = [1 if d in reduced else n for d, n in enumerate(meta.shape) if keepdim or d not in reduced]
    return _fresh(shape, dtype)


def _topk(op_schema: OpSchema, dtypes):
    """topk: values and indices allocated at the input's shape with ``k`` along ``dim``
    (``topk_meta``: ``new_empty``, contiguous whatever the input's layout)."""
    x, k, *rest = op_schema.args_schema
    shape = list(x.tensor_meta.shape)
    dim = rest[0] if rest else op_schema.kwargs_schema.get("dim", -1)
    if not shape or not isinstance(k, int) or not isinstance(dim, int) or not 0 <= k <= shape[dim]:
        return None  # a 0-d input or k out of range: the meta kernel (and its error)
    shape[dim] = k
    return tuple(_fresh(shape, d) for d in dtypes)


def _sort(op_schema: OpSchema, dtypes):
    """sort of a contiguous input: values and indices ``empty_like`` it (``meta_sort``), contiguous."""
    x = op_schema.args_schema[0].tensor_meta
    return tuple(_fresh(x.shape, d) for d in dtypes) if _contiguous(x) else None


def _histc(op_schema: OpSchema, dtype):
    """histc of a floating input: ``bins`` counts, freshly allocated (the meta kernel checks the rest)."""
    x, bins = op_schema.args_schema[0].tensor_meta, (op_schema.args_schema[1:2] or [100])[0]
    if op_schema.kwargs_schema or not x.dtype.is_floating_point or not isinstance(bins, int) or bins <= 0:
        return None
    return _fresh((bins,), dtype)


def _embedding_dense_backward(op_schema: OpSchema, dtype):
    """The embedding weight's gradient: ``(num_weights, grad.size(-1))``, freshly allocated."""
    grad, num_weights = op_schema.args_schema[0].tensor_meta, op_schema.args_schema[2]
    if not grad.shape or not isinstance(num_weights, int) or num_weights < 0:
        return None
    return _fresh((num_weights, grad.shape[-1]), dtype)


def _like_contiguous_self(op_schema: OpSchema, dtype):
    """index_put (out of place: ``empty_like(self)``) and empty_like (preserve format) of a
    contiguous ``self``: contiguous at its shape."""
    x = op_schema.args_schema[0].tensor_meta
    if op_schema.op is aten.empty_like.default and "memory_format" in op_schema.kwargs_schema:
        return None
    return _fresh(x.shape, dtype) if _contiguous(x) else None


def _embedding(op_schema: OpSchema, dtype):
    """embedding of a 2-D weight by integer indices: the rows gathered into a fresh contiguous
    tensor shaped ``indices.shape + (dim,)``."""
    w, ids = op_schema.args_schema[0].tensor_meta, op_schema.args_schema[1].tensor_meta
    if len(w.shape) != 2 or not ids.shape or ids.dtype not in (torch.int64, torch.int32):
        return None
    return _fresh((*ids.shape, w.shape[1]), dtype)

def grouped_mm_shape(op_schema: OpSchema) -> tuple | None:
    """The output sizes of ``_grouped_mm`` (PyTorch's ``_create_grouped_mm_output_tensor``): 2-D x 3-D
    one row per token, 3-D x 2-D and 3-D x 3-D per group, 2-D x 2-D one matrix per offset; None for
    other arguments."""
    a, b = op_schema.args_schema[:2]
    offs = op_schema.args_schema[2] if len(op_schema.args_schema) > 2 else op_schema.kwargs_schema.get("offs")
    if not isinstance(a, DTensorSpec) or not isinstance(b, DTensorSpec):
        return None
    sa, sb = a.shape, b.shape
    if len(sa) == 2 and len(sb) == 3:
        return (sa[0], sb[2])
    if len(sa) == 3 and len(sb) == 2:
        return (sa[1], sb[1])
    if len(sa) == 2 and len(sb) == 2 and isinstance(offs, DTensorSpec):
        return (offs.shape[0], sa[0], sb[1])
    if len(sa) == 3 and len(sb) == 3:
        return (sa[0], sa[1], sb[2])
    return None


def _grouped_mm(op_schema: OpSchema, dtype):
    """``_grouped_mm``: a fresh tensor of ``grouped_mm_shape``, contiguous where PyTorch is built
    without CUDA (a CUDA build pads the last dim's stride to 16 bytes: its meta kernel decides)."""
    shape = None if torch.version.cuda else grouped_mm_shape(op_schema)
    return None if shape is None else _fresh(shape, dtype)


def _gather_rows(op_schema: OpSchema, dtype):
    """``x[idx]`` with one integer index tensor on dim 0 of a contiguous ``x`` (the MoE dispatch's
    token gather): ``idx.shape + x.shape[1:]``, contiguous (the meta kernel follows the restrided
    input's dim order, which for a contiguous input keeps the index dims first)."""
    x, indices = op_schema.args_schema
    if len(indices) != 1 or not isinstance(indices[0], DTensorSpec):
        return None
    idx, m = indices[0].tensor_meta, x.tensor_meta
    if idx.dtype not in (torch.int64, torch.int32) or not m.shape or not _contiguous(m) or 0 in m.shape:
        return None
    return _fresh((*idx.shape, *m.shape[1:]), dtype)


def _cat(op_schema: OpSchema, dtype):
    """cat whose first input suggests the contiguous memory format (``cat_compute_output_memory_format``
    returns contiguous at the first such input; the rotary ``rotate_half`` of heads-first views): a
    fresh contiguous tensor, the inputs' sizes summed along ``dim``. Inputs of other ranks (legacy
    empty ones) or a channels-last first input: the meta kernel."""
    tensors, dim = op_schema.args_schema[0], (op_schema.args_schema[1:2] or [0])[0]
    metas = [t.tensor_meta for t in tensors]
    if not metas or op_schema.kwargs_schema or not metas[0].shape or not isinstance(dim, int):
        return None
    shape = list(metas[0].shape)
    dim %= len(shape)
    rest = shape[:dim] + shape[dim + 1:]
    if any(len(m.shape) != len(shape) or list(m.shape[:dim]) + list(m.shape[dim + 1:]) != rest for m in metas):
        return None
    if not _suggests_contiguous(metas[0]):
        return None
    shape[dim] = sum(m.shape[dim] for m in metas)
    return _fresh(shape, dtype)


def _suggests_contiguous(m: TensorMeta) -> bool:
    if len(m.shape) not in (4, 5):
        return True
    t = torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")
    return torch._prims_common.suggest_memory_format(t) == torch.contiguous_format


_RULES = {
    aten.cat.default: _cat,
    aten.histc.default: _histc,
    aten.embedding_dense_backward.default: _embedding_dense_backward,
    aten.index_put.default: _like_contiguous_self,
    aten.scatter.src: _like_contiguous_self,
    aten.scatter.value: _like_contiguous_self,
    aten.index_put_.default: _in_place,
    aten.squeeze.dim: _squeeze,
    aten._to_copy.default: _to_copy,
    aten.constant_pad_nd.default: _constant_pad,
    aten.embedding.default: _embedding,
    aten.empty_like.default: _like_contiguous_self,
    aten.index.Tensor: _gather_rows,
    aten.floor_divide.default: _elementwise,  # TensorIterator's binary op, without the pointwise tag
    aten.sum.dim_IntList: _reduction,
    aten.mean.dim: _reduction,
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.view_copy.default: _view,
    aten.reshape.default: _view,
    aten.expand.default: _expand,
    aten.slice.Tensor: _slice,
    aten.mm.default: _matmul,
    aten.bmm.default: _matmul,
    aten._grouped_mm.default: _grouped_mm,
    aten.transpose.int: _transpose,
    aten.t.default: _transpose,
    aten.detach.default: _same_as_first,
    aten.alias.default: _same_as_first,
    aten.clone.default: _contiguous_clone,
    aten.unsqueeze.default: _unsqueeze,
    aten.new_zeros.default: _sized_fresh,
    aten.new_ones.default: _sized_fresh,
    aten.new_empty.default: _sized_fresh,
    aten.new_full.default: _sized_fresh,
    aten.slice_backward.default: _sized_fresh,
    aten._softmax.default: _same_as_first,
    aten._log_softmax.default: _same_as_first,
    aten._softmax_backward_data.default: _softmax_backward,
    aten._log_softmax_backward_data.default: _softmax_backward,
    aten.nll_loss_backward.default: _nll_loss_backward,
}


def _pair(rule):
    """A rule for ops returning values and int64 indices (``topk``, ``sort``)."""
    return lambda op_schema, dtypes: rule(op_schema, dtypes) if isinstance(dtypes, tuple) and len(dtypes) == 2 else None


def _single(rule):
    """A rule for ops returning one tensor (one dtype learned)."""
    return lambda op_schema, dtypes: None if isinstance(dtypes, tuple) else rule(op_schema, dtypes)


_TUPLE_RULES = {
    aten.nll_loss_forward.default: _pair(_nll_loss_forward),
    aten.split.Tensor: lambda op_schema, dtypes: _split(op_schema, dtypes) if isinstance(dtypes, tuple) else None,
    aten.topk.default: _pair(_topk),
    aten.sort.default: _pair(_sort),
}

# id(op) -> (op, its rule here or None), decided once per op. Keyed by id: an OpOverload's hash runs
# Python (~0.3 us), and ops live as long as the process (the entry keeps it alive anyway).
_RULE_OF: dict = {}


def _rule_of(op):
    found = _RULE_OF.get(id(op))
    if found is None or found[0] is not op:
        rule = _TUPLE_RULES.get(op)
        if rule is None:
            rule = _RULES.get(op) or (_elementwise if _is_elementwise(op) else _in_place if _is_in_place_elementwise(op) else None)
            rule = None if rule is None else _single(rule)
        found = _RULE_OF[id(op)] = (op, rule)
    return found[1]


def fast_outputs(op_schema: OpSchema, dtypes: torch.dtype | tuple) -> TensorMeta | Sequence[Any] | None:
    """Output TensorMeta(s) by arithmetic, or None where this module does not know them for certain.
    ``dtypes``: the output dtype (a tuple of them for a tuple-returning op) PyTorch gave this op for
    the same input dtypes and non-tensor arguments."""
    rule = _rule_of(op_schema.op)
    if rule is None:
        return None
    try:
        return rule(op_schema, dtypes)
    except (AttributeError, IndexError, TypeError):  # an argument of an unexpected kind
        return None


def miss_outputs(op_schema: OpSchema) -> TensorMeta | Sequence[Any] | None:
    """What PyTorch's miss path learns from its FakeTensor run, where that is arithmetic and the
    dtype certain without a learned answer: ``mm``/``bmm`` of operands of one dtype (a fresh
    contiguous result of that dtype) and ``embedding`` of a 2-D weight by integer indices (the rows
    gathered into a fresh contiguous tensor, shaped ``indices.shape + (dim,)``, the weight's dtype).
    None for anything else (the FakeTensor run decides)."""
    op, args = op_schema.op, op_schema.args_schema
    if op_schema.kwargs_schema or len(args) < 2 or not all(isinstance(a, DTensorSpec) for a in args[:2]):
        return None
    a, b = args[0].tensor_meta, args[1].tensor_meta
    if op in (aten.mm.default, aten.bmm.default) and len(args) == 2 and a.dtype == b.dtype:
        return _matmul(op_schema, a.dtype)
    if op is aten.embedding.default:
        return _embedding(op_schema, a.dtype)
    return None

