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

Handlers go into DTensor's own per-op extension table when parallelize() runs, never at import.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from .local import why_rule_not_local

__all__ = ["install_semantic_handlers", "DTensorRule"]

aten = torch.ops.aten

_MEAN, _SUM = 1, 2  # at::Reduction


class DTensorRule:
    """Call ``op`` with vescale's handler for it taken out of DTensor's table (so DTensor's own rule
    runs), and put the handler back afterwards."""

    def __init__(self, op):
        self.op = op

    def __call__(self, *args, **kwargs):
        table = DTensor._op_dispatcher._custom_op_handlers
        handler = table.pop(self.op, None)
        try:
            return self.op(*args, **kwargs)
        finally:
            if handler is not None:
                table[self.op] = handler


def _global_scalar(op, args, kwargs):
    (t,) = args
    if all(p.is_replicate() for p in t.placements):
        return op(t._local_tensor)
    # Partial or sharded: each rank holds a piece; the value is the global one.
    return op(t.full_tensor())


def _loss_args(op, args, kwargs) -> list:
    """nll_loss(2d)_forward's arguments (self, target, weight, reduction, ignore_index), positional."""
    names = [a.name for a in op._schema.arguments]
    return [*args, *(kwargs[n] for n in names[len(args):])]


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


def _runs_locally(func, args, kwargs) -> bool:
    """For Static Eager's recording: the handler changes nothing where the batch is whole; there
    DTensor's own rule decides (``vescale.dispatch.local``)."""
    return not _splits_batch(func, args, kwargs) and why_rule_not_local(func, args, kwargs) is None


_global_mean_loss.runs_locally = _runs_locally

_HANDLERS = {
    aten._local_scalar_dense.default: _global_scalar,
    aten.nll_loss_forward.default: _global_mean_loss,
    aten.nll_loss2d_forward.default: _global_mean_loss,
}


def install_semantic_handlers() -> None:
    """Register the handlers (idempotent)."""
    DTensor._op_dispatcher._custom_op_handlers.update(_HANDLERS)
