"""Local kernel for the cross-entropy loss: a static module computes its loss on local shards.

Two layouts of a ``cross_entropy(logits, target)`` call make DTensor leave the local shards: the
logits' *classes* sharded on a mesh dim (a vocabulary-parallel LM head whose output stays split),
where DTensor gathers the whole vocabulary for ``log_softmax``; and their *rows* sharded by data
parallelism with ``reduction="mean"``, where ``vescale.dispatch.coverage.semantics`` divides each rank's sum
by the label count all-reduced over the ranks. Either kept the module computing the loss (the model's
root, usually) eager in Static Eager mode, and with it every boundary around its children.

The recorded facts fix both, so static steps run the loss on the local shards instead, computing
eager mode's bits:

* **Recording** (``local_calls.CallWatch``): while the recording step's forward runs, calls of
  ``F.cross_entropy`` on a DTensor are classified (``loss_kernel``). One the kernel can run is
  recorded for the calling module (its k-th call), and the recording runs the kernel itself on the
  DTensors' local shards (``LocalLoss.on_dtensors``), with the op watcher looking away: its ops are
  the kernel's, not the module's own, and the gradient reaches the logits in their own layout, as
  in static steps (DTensor's gather would hand it back whole). Any other call is left to the op
  watcher.
* **Static steps** (``local_calls.LocalCalls``, on while such a module's own body runs): the k-th call runs
  ``LocalLoss``. Sharded classes: the logits are gathered over the class dim (one all-gather, the
  one DTensor's ``log_softmax`` issues in eager mode) and ``F.cross_entropy`` runs on the whole
  rows, eager mode's kernels on eager mode's values; backward hands this rank's classes of the
  whole-row gradient back (a slice: no communication). Sharded rows: the sum over local rows
  divided by the label count all-reduced over the row dims (the collective eager mode issues, and
  its numbers: ``nll_loss``'s mean backward is ``-grad / count``, the division's then the sum's
  backward the same): a ``Partial`` sum, as recorded.

The loss and the logits' gradient are eager mode's bit for bit. (An earlier kernel gathered two
numbers a row instead of the logits, each rank's log-sum-exp over its own classes: a few ulps off
eager mode's loss, and so every gradient of the step. Static Eager is meant to compute eager mode's
bits, so that a user can compare the two modes with ``python -m vescale.debug.compare --atol 0``;
``tests/static/test_static_equal.py``.) What differs from eager mode is where the whole-row gradient
goes: eager DTensor hands it to the LM head replicated, whose weight gradient then is a matmul over
the whole vocabulary, sliced afterwards; a static LM head gets its own classes and multiplies those
(the same products, in a matmul of other sizes). The zoo plans gather the logits at the LM head's
output instead (``plan.shard("lm_head.<out>", Replicate())``), where both modes slice the gradient
at that move and the loss runs on whole rows in both: equal bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from vescale._torch import DTensorSpec, TensorMeta

from ..comm import direct
from ..comm.moves import compile_move
from ..dispatch.metas import contiguous_strides
from ..plan.ir import PlanError
from ..placement.blocks import local_shape_and_offset

__all__ = ["LocalLoss", "loss_kernel", "cross_entropy_args"]

_ARGS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
_DEFAULTS = (None, None, None, None, -100, None, "mean", 0.0)


def cross_entropy_args(args: tuple, kwargs: dict) -> dict:
    values = dict(zip(_ARGS, _DEFAULTS))
    values.update(zip(_ARGS, args))
    values.update(kwargs)
    return values


@dataclass(frozen=True)
class LocalLoss:
    """A recorded cross entropy: classes sharded on ``class_dim`` (None: whole), this rank holding
    classes ``offset .. offset + classes`` of ``total``; rows sharded on ``row_dims``."""

    mesh: DeviceMesh
    class_dim: int | None
    offset: int
    classes: int
    total: int
    row_dims: tuple
    reduction: str
    ignore_index: int

    def __call__(self, logits: torch.Tensor, target: torch.Tensor, call: dict) -> torch.Tensor:
        self._check(logits, target, call)
        if self.class_dim is not None:  # a target outside the classes then raises as on one device
            logits = _GatherClasses.apply(logits, self)
        if not self.row_dims:  # the call as eager mode runs it on the whole rows
            return F.cross_entropy(logits, target, ignore_index=self.ignore_index, reduction=self.reduction)
        total = F.cross_entropy(logits, target, ignore_index=self.ignore_index, reduction="sum")
        if self.reduction == "sum":
            return total
        count = (target != self.ignore_index).sum()
        for d in self.row_dims:  # the labels every rank of the batch counts, as eager mode all-reduces them
            direct.all_reduce(count, self.mesh.get_group(d))
        return total / count

    def on_dtensors(self, call: dict) -> DTensor:
        """The recording step's loss: this kernel on the local shards, the result a DTensor laid out
        as eager mode's (a sum Partial over the row dims, whole elsewhere). So the recording sees the
        gradient arrive in the logits' own layout, as static steps will."""
        logits, target = call["input"], call["target"]
        local = logits.to_local(grad_placements=logits.placements)
        out = self(local, target.to_local() if isinstance(target, DTensor) else target, call)
        placements = tuple(Partial("sum") if d in self.row_dims else Replicate() for d in range(self.mesh.ndim))
        return DTensor.from_local(out, self.mesh, placements, run_check=False)

    def _check(self, logits, target, call: dict) -> None:
        if (call["reduction"], call["ignore_index"]) != (self.reduction, self.ignore_index):
            raise PlanError(
                f"cross_entropy(reduction={call['reduction']!r}, ignore_index={call['ignore_index']}) in a static step "
                f"was recorded as reduction={self.reduction!r}, ignore_index={self.ignore_index}; a module must call "
                f"its loss the same way every step (or stay on DTensors with plan.eager)"
            )
        if logits.ndim != 2 or logits.shape[1] != self.classes or target.shape != logits.shape[:1]:
            raise PlanError(
                f"cross_entropy on local logits {tuple(logits.shape)} and targets {tuple(target.shape)} in a static "
                f"step; recorded: (rows, {self.classes}) logits with one target a row. Keep the module on DTensors "
                f"with plan.eager(...)"
            )


class _GatherClasses(torch.autograd.Function):
    """Logits whose classes are split over a mesh dim, gathered whole (what DTensor's
    ``log_softmax`` does to them in eager mode); the gradient goes back as this rank's classes of
    the whole-row gradient, contiguous (what DTensor's ``Replicate -> Shard`` move gives)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, kernel: LocalLoss) -> torch.Tensor:
        ctx.kernel = kernel
        ctx.local_shape = logits.shape
        ctx.dtype = logits.dtype
        return _class_move(kernel, logits.shape[0], logits.dtype, Shard(1), Replicate())(logits.contiguous())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        kernel = ctx.kernel
        move = _class_move(kernel, ctx.local_shape[0], ctx.dtype, Replicate(), Shard(1))
        return move(grad.contiguous()).contiguous(), None


def _class_move(kernel: LocalLoss, rows: int, dtype, src, dst):
    """The move of (rows, classes) logits between ``src`` and ``dst`` on the class dim (the other
    mesh dims hold the rows as they are: each rank's own)."""
    mesh = kernel.mesh
    placements = [Replicate()] * mesh.ndim
    shape = torch.Size((rows, kernel.total))
    meta = TensorMeta(shape, contiguous_strides(tuple(shape)), dtype)
    specs = []
    for p in (src, dst):
        placements[kernel.class_dim] = p
        specs.append(DTensorSpec(mesh, tuple(placements), tensor_meta=meta))
    return compile_move(*specs) or (lambda t: t)


# ---------------------------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------------------------


def loss_kernel(call: dict) -> LocalLoss | None:
    """The ``LocalLoss`` for a ``cross_entropy`` call on DTensor logits (``call``: its arguments by
    name), or None where the kernel does not apply (the op watcher then judges its ops)."""
    logits, target = call["input"], call["target"]
    if not isinstance(logits, DTensor) or logits.ndim != 2 or not isinstance(target, torch.Tensor):
        return None
    if target.ndim != 1 or target.is_floating_point() or call["weight"] is not None:
        return None  # class probabilities or class weights: not written here
    if call["size_average"] is not None or call["reduce"] is not None or call["label_smoothing"] != 0.0:
        return None
    if call["reduction"] not in ("mean", "sum"):
        return None
    mesh, placements = logits.device_mesh, logits.placements
    target_placements = target.placements if isinstance(target, DTensor) else (Replicate(),) * mesh.ndim
    if isinstance(target, DTensor) and target.device_mesh != mesh:
        return None
    class_dims, row_dims = [], []
    for d, (p, t) in enumerate(zip(placements, target_placements)):
        if mesh.size(d) == 1:
            continue
        if p == Shard(0) and t == Shard(0):
            row_dims.append(d)
        elif p in (Shard(1), Shard(-1)) and t.is_replicate():
            class_dims.append(d)
        elif not (p.is_replicate() and t.is_replicate()):
            return None
    if len(class_dims) > 1 or not (class_dims or row_dims):
        return None  # nothing to do (the ops run locally as they are), or classes split twice
    shape, offset = local_shape_and_offset(logits.shape, mesh, placements)
    return LocalLoss(mesh, class_dims[0] if class_dims else None, int(offset[1]), int(shape[1]), int(logits.shape[1]),
                     tuple(row_dims), call["reduction"], int(call["ignore_index"]))
