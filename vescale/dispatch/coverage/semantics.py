"""Op handlers that make DTensor answer like the single-device tensor it stands for.

* ``item()`` (aten._local_scalar_dense) on a DTensor returns the *local* value in PyTorch, which for
  a Partial DTensor — a loss over a batch-sharded output, say — is this rank's partial result,
  different on every rank. Under vescale's contract a DTensor is its global tensor, so ``item()``,
  ``float()`` and ``tolist()`` of a one-element tensor return the global value.
* ``nll_loss`` with ``reduction="mean"`` (what ``cross_entropy`` runs) over a batch-sharded input:
  PyTorch's rule makes the loss ``Partial("avg")``, the average of the ranks' own means, which is
  the single-device mean only when every rank counts the same number of labels. With
  ``ignore_index`` (padding, prompt tokens masked out of the loss) ranks count different numbers,
  and the loss value differs from the single device's while its backward — which divides by the
  label count all-reduced over the ranks — does not. Here the loss is the single device's: each
  rank's *sum* divided by the all-reduced count, a ``Partial("sum")`` value, and the count handed to
  backward is that global count, so value and gradient agree with one device.
* Losses with a fused kernel and ``reduction="mean"`` (``mse_loss``, ``smooth_l1_loss``,
  ``huber_loss``, ``binary_cross_entropy``, ``soft_margin_loss``, and the value of
  ``binary_cross_entropy_with_logits``) over a sharded input: PyTorch's rule averages the ranks'
  means (wrong for an uneven split), and their backward kernels divide by the *local* element count
  while the gradient arriving is the global one, so the input gradient is n times too large even
  for an even split (a diffusion model's ``F.mse_loss`` under DP, say). Here the forward is each
  rank's sum divided by the global element count (``Partial("sum")``), and the backward runs the
  sum's backward on the arriving gradient divided by the same count: the single device's value and
  gradient.

Handlers go into DTensor's own per-op extension table when parallelize() runs, never at import, and
answer for DTensors on vescale's meshes only (``scope.py``).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..local import runs_locally_when, why_rule_not_local
from ..scope import DTensorRule, for_vescale_meshes
from vescale._torch import PATCHES

__all__ = ["install_semantic_handlers"]

aten = torch.ops.aten

_MEAN, _SUM = 1, 2  # at::Reduction


@for_vescale_meshes
def _global_scalar(op, args, kwargs):
    (t,) = args
    if all(p.is_replicate() for p in t.placements):
        return op(t._local_tensor)
    # Partial or sharded: each rank holds a piece; the value is the global one.
    return op(t.full_tensor())


def _bound(op, args, kwargs) -> dict:
    """The op's arguments by schema name, defaults filled in (in schema order)."""
    bound = {}
    for i, a in enumerate(op._schema.arguments):
        bound[a.name] = args[i] if i < len(args) else kwargs.get(a.name, a.default_value if a.has_default_value() else None)
    return bound


def _loss_args(op, args, kwargs) -> list:
    """nll_loss(2d)_forward's arguments (self, target, weight, reduction, ignore_index), positional."""
    return list(_bound(op, args, kwargs).values())


def _batch_split_dims(logp) -> list[int]:
    """Mesh dims (of more than one rank) that split ``logp``'s batch (any dim but the class dim)."""
    class_dim = 1 if logp.ndim >= 2 else 0
    return [
        i for i, p in enumerate(logp.placements)
        if isinstance(p, Shard) and p.dim % logp.ndim != class_dim and logp.device_mesh.size(i) > 1
    ]


def _splits_batch(op, args, kwargs) -> bool:
    """Whether the handler changes DTensor's answer: a mean over a batch split across ranks."""
    logp, _, _, reduction, _ = _loss_args(op, args, kwargs)
    return reduction == _MEAN and isinstance(logp, DTensor) and bool(_batch_split_dims(logp))


@for_vescale_meshes
def _global_mean_loss(op, args, kwargs):
    """nll_loss forward, mean reduction: the sum over this rank's labels divided by the count of
    labels (or their total weight) over all ranks — the single device's mean, as Partial("sum")."""
    if not _splits_batch(op, args, kwargs):
        return DTensorRule(op)(*args, **kwargs)
    logp, target, weight, _, ignore_index = _loss_args(op, args, kwargs)
    total, count = DTensorRule(op)(logp, target, weight, _SUM, ignore_index)
    # The sum is Partial("sum") where the batch is split; the count too: all-reduce it there.
    count = count.redistribute(count.device_mesh, [Replicate() if p.is_partial() else p for p in count.placements])
    mean = DTensor(total._local_tensor / count._local_tensor, total._spec, requires_grad=False)
    return mean, count


def _split_dims(t) -> list[int]:
    """Mesh dims (of more than one rank) that shard ``t``."""
    return [i for i, p in enumerate(t.placements) if isinstance(p, Shard) and t.device_mesh.size(i) > 1]


def _mean_over_split(op, args, kwargs) -> dict | None:
    """The bound arguments if the op reduces with a mean over an input split across ranks (what the
    pointwise-loss handler changes), else None."""
    bound = _bound(op, args, kwargs)
    t = bound["self"]
    if bound["reduction"] != _MEAN or not isinstance(t, DTensor) or not _split_dims(t):
        return None
    return bound


@for_vescale_meshes
def _global_mean_pointwise_loss(op, args, kwargs):
    """A fused pointwise loss, mean reduction, over a split input: this rank's sum over the global
    element count (forward), and the sum's backward of the arriving gradient over that count."""
    bound = _mean_over_split(op, args, kwargs)
    if bound is None:
        return DTensorRule(op)(*args, **kwargs)
    count = bound["self"].numel()  # the global element count: a DTensor's sizes are global
    bound["reduction"] = _SUM
    if "grad_output" in bound:
        bound["grad_output"] = bound["grad_output"] / count
        return DTensorRule(op)(*bound.values())
    total = DTensorRule(op)(*bound.values())
    return DTensor(total._local_tensor / count, total._spec, requires_grad=False)


def _pointwise_runs_locally(func, args, kwargs) -> bool:
    return _mean_over_split(func, args, kwargs) is None and why_rule_not_local(func, args, kwargs) is None


runs_locally_when(_global_mean_pointwise_loss, _pointwise_runs_locally)

# Fused-kernel losses whose mean DTensor gets wrong over a split input (forward and backward);
# binary_cross_entropy_with_logits' backward decomposes into ops DTensor gets right.
_POINTWISE_LOSSES = [
    aten.mse_loss.default, aten.mse_loss_backward.default,
    aten.smooth_l1_loss.default, aten.smooth_l1_loss_backward.default,
    aten.huber_loss.default, aten.huber_loss_backward.default,
    aten.binary_cross_entropy.default, aten.binary_cross_entropy_backward.default,
    aten.soft_margin_loss.default, aten.soft_margin_loss_backward.default,
    aten.binary_cross_entropy_with_logits.default,
]


def _runs_locally(func, args, kwargs) -> bool:
    """For Static Eager's recording: the handler changes nothing where the batch is whole; there
    DTensor's own rule decides (``vescale.dispatch.local``)."""
    return not _splits_batch(func, args, kwargs) and why_rule_not_local(func, args, kwargs) is None


runs_locally_when(_global_mean_loss, _runs_locally)

_HANDLERS = {
    aten._local_scalar_dense.default: _global_scalar,
    aten.nll_loss_forward.default: _global_mean_loss,
    aten.nll_loss2d_forward.default: _global_mean_loss,
    **{op: _global_mean_pointwise_loss for op in _POINTWISE_LOSSES},
}


def install_semantic_handlers(owner: str = "dispatch.coverage.semantics") -> None:
    """Register the handlers (idempotent); ``owner`` names the installer for ``PATCHES.undo``."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op, handler in _HANDLERS.items():
        PATCHES.set_item(owner, handlers, op, handler, f"DTensor custom handler {op}")


