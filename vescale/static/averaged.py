"""Averaged Partial values leaving Static Eager code: the gradient rule at the boundary.

A mean over a dimension sharded by data parallelism (``x.mean()`` of a batch-sharded tensor, a
loss reduced that way) gives DTensor a ``Partial("avg")`` value: each rank holds the mean of its own
shard, and the value is the average of the ranks' means. Its gradient in eager DTensor is
``Replicate`` (the whole gradient ``G`` on every rank), and the backward of the op that made it runs
with *global* sizes (``mean``'s backward divides by the global element count). In a static module
the same op runs on the local shard and its backward divides by the *local* count, n times smaller. Chain rule: the averaged value is
``(1/n) * sum(local_r)``, so the gradient of rank r's local value is ``G / n``; with that, the local
backward gives ``G / (n * N_local) = G / N``, what eager DTensor computes (bit for bit when n is a
power of two: the scaling is exact).

So where static code hands an averaged Partial over as a DTensor (``_wrap``: a static module's
output to an eager caller or the user, or a static caller's argument to an eager child), its local
gradient is the arriving gradient, laid out ``Replicate`` on that mesh dim, divided by the dim's size
(``wrap_divisor``). That holds when the value flows from the op that made it to the boundary without
any other op of static code consuming it (passing it through calls and returns is fine): an op
that multiplied it with a parameter, say, would compute that parameter's gradient from ``G / n``
where eager DTensor uses ``G``. The runtime keeps a module eager when one of its ops consumes an
averaged Partial (``consumes_average``), when one would enter static code (unwrapped), or when a
plan states a gradient layout for it other than ``Replicate`` on the averaged dim
(``wrap_refusal``).

The caveat DTensor itself has: its mean over ranks is the single-device mean only when every rank
averages the same number of elements (true of a plain ``mean`` over an evenly split batch). The
loss with ignored labels is not such a value: ``vescale.dispatch.coverage.semantics`` divides each rank's sum
by the global label count there, a ``Partial("sum")`` loss, and a module computing it stays eager
(its count is all-reduced in forward).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.distributed.tensor import DTensor
from vescale._torch import tree_leaves

if TYPE_CHECKING:
    from vescale._torch import DTensorSpec

__all__ = ["averaged_dims", "wrap_divisor", "wrap_refusal", "consumes_average", "divide_grad"]


def averaged_dims(spec: DTensorSpec | None) -> list[int]:
    """Mesh dims (of more than one rank) on which ``spec`` is a non-sum Partial."""
    if spec is None:
        return []
    return [
        i for i, p in enumerate(spec.placements)
        if p.is_partial() and getattr(p, "reduce_op", "sum") != "sum" and spec.mesh.size(i) > 1
    ]


def describe(spec: DTensorSpec | None) -> str | None:
    """The first averaged placement of ``spec`` as text (None if it has none)."""
    dims = averaged_dims(spec)
    return f"{spec.placements[dims[0]]} on mesh dim {dims[0]}" if dims else None


def wrap_divisor(spec: DTensorSpec | None) -> int:
    """What a local gradient is divided by where a local value becomes the DTensor ``spec``: the
    number of ranks it is averaged over (1 when it is not averaged)."""
    n = 1
    for i in averaged_dims(spec):
        n *= spec.mesh.size(i)
    return n


def wrap_refusal(spec: DTensorSpec | None, grad_placements: tuple | None) -> str | None:
    """Why an averaged value cannot leave static code with gradients in ``grad_placements`` (None:
    from_local's default, Replicate on the averaged dims, which the rule needs)."""
    for i in averaged_dims(spec):
        if grad_placements is not None and not grad_placements[i].is_replicate():
            return (f"a tensor crossing its boundary is {spec.placements[i]} on mesh dim {i} (averaged over "
                    f"ranks) with its gradient stated as {grad_placements[i]}: only a Replicate gradient has "
                    f"a local rule")
    return None


def consumes_average(func: Callable[..., Any], args: tuple, kwargs: dict) -> str | None:
    """Why ``func`` (a DTensor op of a module's body, while recording) must not run in static code:
    one of its inputs is an averaged Partial (see the module docstring)."""
    for a in tree_leaves((args, kwargs)):
        if isinstance(a, DTensor):
            what = describe(a._spec)
            if what is not None:
                return f"{func} consumes a value that is {what} (averaged over ranks)"
    return None


class _DivideGrad(torch.autograd.Function):
    """Identity forward; backward divides the gradient by ``n``."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, n: int) -> torch.Tensor:
        ctx.n = n
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        return (None if grad is None else grad / ctx.n), None


def divide_grad(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t``, whose gradient is divided by ``n`` on the way back."""
    if n == 1 or not t.requires_grad:
        return t
    return _DivideGrad.apply(t, n)
