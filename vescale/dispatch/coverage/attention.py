"""Sharding rules for scaled-dot-product attention (SDPA) where PyTorch 2.13 has none.

``F.scaled_dot_product_attention`` — the default attention of HF transformers and diffusers — picks
a fused kernel per device. PyTorch ships DTensor rules for the CUDA ones (flash, memory-efficient,
cuDNN: ``torch/distributed/tensor/_ops/_matrix_ops.py``) but not for the CPU one, so a model with
its default attention failed under TP on CPU. This module adds the CPU flash kernel, forward and
backward (a handler, see below), with the same two rules PyTorch gives the CUDA kernels:

* heads-sharded (tensor parallel): q/k/v, output, logsumexp and gradients ``Shard(1)``;
* batch-sharded (data parallel): all of them ``Shard(0)``;

plus all-Replicate. An ``attn_mask`` follows q on a dim it has at full size and is replicated on a
broadcast (size-1 or missing) dim. A heads-sharded rule is valid only when every head count
divides by the shards: with grouped-query attention (fewer k/v heads than q heads) the kernel pairs
local query head ``i`` with local k/v head ``i // (Hq/Hkv)``, which is the global pairing only if
both are split into the same number of equal blocks.

Dropout inside SDPA (``dropout_p > 0``): on CPU no fused kernel takes dropout, so PyTorch runs its
math decomposition (matmul, softmax, ``bernoulli_`` mask, matmul), whose mask is drawn by
``vescale.random``'s handler for ``bernoulli_`` — each element from its global index, so it equals
the single-device mask under ``vescale.random.consistent()``. The CUDA fused kernels draw their
own Philox stream inside the kernel, which no rank can align with a single device; on DTensors
:func:`refuse_fused_dropout` turns that into an error that names the fix (the math kernel, via
``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``), instead of rank-local dropout masks. (Decided
against rewriting a fused call into math attention below autograd: its backward would have to
replay the mask from the kernel's saved philox state; the math kernel already does it right.)

Why a handler for the CPU kernel and not a strategy: the CPU kernel takes ``attn_mask`` as a
keyword argument, and PyTorch 2.13's propagator never redistributes keyword tensors, so a
replicated mask (the usual case: masks are made from plain tensors) would reach a batch-sharded
kernel whole. The handler (in DTensor's ``_custom_op_handlers``) applies the rule itself:
:func:`sdpa_layout` picks the layout from q, every tensor is redistributed to it (a no-op when it
already is), the kernel runs on local shards, and the outputs are wrapped with the global shapes
the op's meta kernel gives. That decision (layout and global output sizes) is kept per call signature
(the argument specs and scalars), so a repeated call only moves what is off the layout, runs the
kernel and wraps its outputs: no meta-kernel run per call. The CUDA kernels keep PyTorch's strategies (their bias is positional),
wrapped by the dropout refusal; the cuDNN ones are fixed first (2.13 crashes on a forward with
``attn_bias`` and replicates a backward whose bias broadcasts). Installed by ``install()``, never at
import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from vescale._torch import DTensorSpec, TensorMeta, OpSchema, OpStrategy, RuntimeSchemaInfo, _matrix_ops, expand_to_full_mesh_op_strategy, PATCHES
from ..local import runs_locally_when
from ..scope import for_vescale_meshes
from vescale.memo import Memo

if TYPE_CHECKING:
    from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "install_attention_rules", "sdpa_layout", "CPU_SDPA_OPS", "FUSED_DROPOUT_ARG", "FusedDropoutError",
    "refuse_fused_dropout", "clear_sdpa_decisions",
]

aten = torch.ops.aten
_HEADS, _BATCH = 1, 0  # SDPA tensors are (batch, heads, sequence, head_dim); logsumexp (batch, heads, seq)


def sdpa_layout(q: DTensor, heads: tuple[int, ...]) -> tuple:
    """The rule: per mesh dim, q's placement if it is ``Shard(0)`` (batch) or ``Shard(1)`` (heads),
    else Replicate. A heads split must divide every head count in ``heads`` evenly, or it is
    replicated instead (GQA pairs local q head i with local k/v head i // (Hq/Hkv))."""
    mesh, kept = q.device_mesh, []
    for p in q.placements:
        kept.append(p if type(p) is Shard and p.dim in (_BATCH, _HEADS) else Replicate())
    split = 1
    for mesh_dim, p in enumerate(kept):
        if p == Shard(_HEADS):
            split *= mesh.size(mesh_dim)
    if any(h % split for h in heads):
        kept = [Replicate() if p == Shard(_HEADS) else p for p in kept]
    return tuple(kept)


def _mask_layout(mask: torch.Tensor, layout, like_ndim: int) -> tuple:
    """``attn_mask`` follows q on a dim it has at full size, and is replicated on a broadcast one."""
    out = []
    for p in layout:
        dim = p.dim - (like_ndim - mask.ndim) if isinstance(p, Shard) else -1
        out.append(Shard(dim) if dim >= 0 and mask.shape[dim] > 1 else Replicate())
    return tuple(out)


def _meta(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t


def _sdpa_decision(op, args, kwargs):
    """(layout, mask layout or None, global output (shape, dtype)s) of a call: the rule applied to q's
    placements and the head counts, the output sizes from the op's meta kernel on the global inputs."""
    first = 0 if op is aten._scaled_dot_product_flash_attention_for_cpu.default else 1  # q's position
    q = args[first]
    if not isinstance(q, DTensor):
        q = next(a for a in args if isinstance(a, DTensor))
    heads = [a.shape[_HEADS] for a in args[first:first + 3] if isinstance(a, torch.Tensor)]
    layout = sdpa_layout(q, tuple(heads))
    index = 3 if first == 0 else 6  # dropout_p
    dropout_p = args[index] if len(args) > index else kwargs.get("dropout_p", 0.0)
    if dropout_p:
        raise FusedDropoutError(_dropout_message(op, dropout_p))
    mask = kwargs.get("attn_mask")
    mask_layout = _mask_layout(mask, layout, q.ndim) if isinstance(mask, torch.Tensor) else None
    metas = op(*[_meta(a) for a in args], **{k: _meta(v) for k, v in kwargs.items()})
    return q.device_mesh, layout, mask_layout, tuple((m.shape, m.dtype) for m in metas)


def _decision_key(op, args, kwargs):
    """The decision depends on the DTensor specs (global shapes, strides, placements), the scalar
    arguments and the mask's spec; None (not kept) when a plain tensor is an argument."""
    parts = [op]
    for name, value in [(None, a) for a in args] + list(kwargs.items()):
        if isinstance(value, DTensor):
            parts.append((name, value._spec))
        elif isinstance(value, torch.Tensor):
            return None
        else:
            parts.append((name, type(value), value))
    return tuple(parts)


# Decisions of repeated calls: per call the handler then only moves what is off the layout (nothing,
# in a model whose q/k/v follow the rule), runs the kernel and wraps its outputs. Emptied at the limit
# (global shapes are part of the key, as in PyTorch's own sharding cache).
_SDPA_DECISIONS = Memo("CPU SDPA decisions", 1024)


def clear_sdpa_decisions() -> None:
    _SDPA_DECISIONS.clear()


@for_vescale_meshes
def _cpu_sdpa_handler(op, args, kwargs):
    """CPU flash SDPA, forward or backward, on DTensors (see module doc): every tensor argument is
    brought to one layout (no communication when the inputs already follow the rule), the kernel runs
    on local shards, the outputs take that layout."""
    kwargs = dict(kwargs or {})
    key = _decision_key(op, args, kwargs)
    entry = _SDPA_DECISIONS.get(key) if key is not None else None
    if entry is None:
        entry = _sdpa_decision(op, args, kwargs) + ({},)  # the last: output specs by local strides
        if key is not None:
            _SDPA_DECISIONS.put(key, entry)
    mesh, layout, mask_layout, metas, specs = entry

    def place(t: torch.Tensor, placements: Sequence[Placement]) -> torch.Tensor:
        if not isinstance(t, DTensor):  # a plain tensor is the global tensor: every rank slices its block
            t = DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return t.redistribute(mesh, placements)._local_tensor if t.placements != placements else t._local_tensor

    local_args = [place(a, layout) if isinstance(a, torch.Tensor) else a for a in args]
    mask = kwargs.get("attn_mask")
    if isinstance(mask, torch.Tensor):
        kwargs["attn_mask"] = place(mask, mask_layout)
    results = op(*local_args, **kwargs)
    strides = tuple(r.stride() for r in results)
    out_specs = specs.get(strides)
    if out_specs is None:  # the kernel's local layouts (see _stride_like) are few: kept per entry
        out_specs = specs[strides] = tuple(
            DTensorSpec(mesh, layout, tensor_meta=TensorMeta(shape, _stride_like(r, shape), dtype))
            for r, (shape, dtype) in zip(results, metas)
        )
    return tuple(DTensor(r, spec, requires_grad=False) for r, spec in zip(results, out_specs))


def _runs_locally(op, args, kwargs) -> bool:
    """Whether the handler would run the kernel on the local shards as they are: every tensor is a
    DTensor already in the rule's layout (Static Eager asks this to keep attention static)."""
    kwargs = kwargs or {}
    first = 0 if op is aten._scaled_dot_product_flash_attention_for_cpu.default else 1
    q = args[first]
    if not isinstance(q, DTensor):
        return False
    heads = [a.shape[_HEADS] for a in args[first:first + 3] if isinstance(a, torch.Tensor)]
    layout = sdpa_layout(q, tuple(heads))
    if any(isinstance(a, torch.Tensor) and not (isinstance(a, DTensor) and a.placements == layout) for a in args):
        return False
    mask = kwargs.get("attn_mask")
    if isinstance(mask, torch.Tensor):
        return isinstance(mask, DTensor) and mask.placements == _mask_layout(mask, layout, q.ndim)
    return True


runs_locally_when(_cpu_sdpa_handler, _runs_locally)


def _stride_like(local: torch.Tensor, shape) -> tuple[int, ...]:
    """Global strides with the local result's dim order. The CPU kernel returns (B, H, L, E) laid out
    as (B, L, H, E), while its meta kernel says contiguous; a DTensor whose global strides disagree
    with its local tensor's makes later views (``transpose(1, 2).reshape``) fail locally."""
    order = sorted(range(local.ndim), key=lambda d: (-local.stride(d), -d))  # outermost first
    stride, step = [0] * local.ndim, 1
    for d in reversed(order):
        stride[d] = step
        step *= shape[d]
    return tuple(stride)


CPU_SDPA_OPS = (
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
)


# CUDA fused kernels with PyTorch rules, and the position of their dropout_p argument.
FUSED_DROPOUT_ARG = {
    aten._scaled_dot_product_flash_attention.default: 3,
    aten._scaled_dot_product_efficient_attention.default: 5,
    aten._scaled_dot_product_cudnn_attention.default: 5,
}


class FusedDropoutError(NotImplementedError):
    """SDPA's in-kernel dropout on DTensors: rank-local masks (see the message for the fix)."""


def _dropout_message(op, p) -> str:
    return (
        f"vescale: {op} with dropout_p={p} on DTensors: the fused kernel draws its dropout mask "
        "inside the kernel from each rank's own generator, so no rank's mask is the single-device "
        "one. Run attention with the math kernel, whose dropout mask vescale's RNG draws element by "
        "element: wrap the training step in "
        "`with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):` "
        "(or train with attention dropout 0)."
    )


def refuse_fused_dropout(op: Any, strategy: Callable[[OpSchema], OpStrategy]) -> Callable[[OpSchema], OpStrategy]:
    """PyTorch's ``strategy`` for a fused CUDA kernel, refusing ``dropout_p > 0``."""
    index = FUSED_DROPOUT_ARG[op]

    def checked(op_schema: OpSchema) -> OpStrategy:
        args = op_schema.args_schema
        p = args[index] if len(args) > index else 0.0
        if p:
            raise FusedDropoutError(_dropout_message(op, p))
        return strategy(op_schema)

    return checked


def _bias_placement(bias, q_placement, q_shape):
    """An attention bias follows q's split on a dim it has at full size; a broadcast (size-1) dim
    is read whole by every shard."""
    shape = tuple(bias.strategies[0].output_spec.shape)
    if isinstance(q_placement, Shard) and shape[q_placement.dim] == q_shape[q_placement.dim]:
        return q_placement
    return Replicate()


def _cudnn_forward(op_schema: OpSchema):
    """PyTorch's cuDNN rules with the bias placed in the heads and batch rules too (2.13 adds it to
    all-Replicate only, so a call with ``attn_bias`` fails with ``input_specs(3) != strategies(4)``)."""
    rules = _matrix_ops._scaled_dot_product_cudnn_attention_base_strategies(op_schema)
    q, bias = op_schema.args_schema[0], op_schema.args_schema[3]
    if isinstance(bias, OpStrategy):
        for row in rules:
            if len(row) == 12:  # outputs (9) + q, k, v: the bias is missing
                row.append(_bias_placement(bias, row[9], tuple(q.strategies[0].output_spec.shape)))
    mesh = op_schema.get_mesh_from_args()
    return expand_to_full_mesh_op_strategy(mesh, op_schema, rules, input_index=9)


def _cudnn_backward(op_schema: OpSchema):
    """PyTorch's cuDNN backward rules with a broadcast bias replicated instead of split on a size-1
    dim (which filtered out the heads and batch rules: the whole backward ran replicated)."""
    rules = _matrix_ops._scaled_dot_product_cudnn_attention_backward_base_strategies(op_schema)
    q, bias = op_schema.args_schema[1], op_schema.args_schema[8]
    if isinstance(bias, OpStrategy):
        for row in rules:
            row[3 + 8] = _bias_placement(bias, row[3 + 1], tuple(q.strategies[0].output_spec.shape))
    mesh = op_schema.get_mesh_from_args(validate=False)
    return expand_to_full_mesh_op_strategy(mesh, op_schema, rules, input_index=3)


_OWNER = "dispatch.coverage.attention"

# Strategies that replace PyTorch's for an op (fixes of 2.13's rules), before the dropout check.
_FIXED = {
    aten._scaled_dot_product_cudnn_attention.default: _cudnn_forward,
    aten._scaled_dot_product_cudnn_attention_backward.default: _cudnn_backward,
}


def install_attention_rules() -> None:
    """Register the rules with DTensor's sharding propagator (idempotent; PyTorch's own rule wins
    if a later PyTorch ships one)."""
    if PATCHES.owners(_OWNER):
        return
    prop = DTensor._op_dispatcher.sharding_propagator
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in CPU_SDPA_OPS:
        if op not in prop.op_strategy_funcs and op not in prop.op_single_dim_strategy_funcs and op not in handlers:
            PATCHES.set_item(_OWNER, handlers, op, _cpu_sdpa_handler, f"DTensor custom handler {op}")
    for op, fixed in _FIXED.items():
        if op in prop.op_strategy_funcs:
            PATCHES.set_item(_OWNER, prop.op_strategy_funcs, op, fixed, f"DTensor strategy {op}")
    for op, index in FUSED_DROPOUT_ARG.items():
        strategy = prop.op_strategy_funcs.get(op)
        if strategy is None:
            continue
        # dropout_p must be part of the sharding cache key (PyTorch's flash key starts after it).
        old = prop.op_to_schema_info.get(op) or RuntimeSchemaInfo()
        info = RuntimeSchemaInfo(min(old.static_argnum, index), old.static_kwargkey, old.needs_pytree)
        PATCHES.set_item(_OWNER, prop.op_strategy_funcs, op, refuse_fused_dropout(op, strategy), f"DTensor strategy {op}")
        PATCHES.set_item(_OWNER, prop.op_to_schema_info, op, info, f"DTensor schema info {op}")


