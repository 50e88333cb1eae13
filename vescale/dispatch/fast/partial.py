"""Partial-sum strategies PyTorch's rules leave out for ops that are linear in their tensor inputs.

``scatter(self, dim, index, src)`` writes ``src`` into a copy of ``self`` at ``index``: with the
index fixed it is linear in ``(self, src)`` together, so on ranks holding partial sums of both the
results are partial sums of the global result (``Partial("sum")``; a Replicate ``self`` becomes
partial for free: one rank keeps it, the others hold zeros). PyTorch 2.13's ``scatter_strategy``
offers Replicate and shards of the other dims only, so a Partial ``src`` is reduce-scattered over
the rows (or all-reduced). That is what a top-k's backward meets in an MoE router: the routing
weights' gradient arrives Partial over TP (the experts' outputs are partial sums), and the
reduce-scatter shards the whole router backward, costing four redistributions per layer where one
all-reduce at the softmax backward suffices. With the Partial strategy beside PyTorch's own, the
cost search keeps the gradient Partial until an op that needs it whole.

Only ``aten.scatter.src``: the in-place variant cannot change ``self``'s placement, the ``.value``
overloads write a constant (not linear), and ``scatter_reduce`` / ``scatter_add`` have their own
rules (``datadep``).

``_softmax_backward_data(grad, y, dim)`` is ``y * (grad - sum(grad * y, dim))``: with the softmax
output ``y`` whole along ``dim``, linear in ``grad``. PyTorch's rule replicates a Partial ``grad``
first (an all-reduce); beside it, [grad_in, grad, y] = [P, P, R] keeps the router's gradient Partial
through its softmax, so the router's backward sums with the experts' (also Partial over TP) without
a reduction of its own, and Static Eager can run the router on local tensors.

Installed into the propagator's table by ``install()``, never at import.
"""

from __future__ import annotations


import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from vescale._torch import OpSchema, OpStrategy, expand_to_full_mesh_op_strategy, PATCHES

__all__ = ["install_partial_rules", "uninstall_partial_rules"]

aten = torch.ops.aten
_OWNER = "dispatch.fast.partial"


def _scatter_with_partial(original):
    """PyTorch's scatter strategies plus, per mesh dim, [out, self, index, src] = [P, P, R, P]
    (combined over the mesh with the all-Replicate rule and the shards of the other dims, the
    all-Replicate rule listed first: among equally cheap
    combinations the search keeps the first, and a needless Partial dim would cost a reduction
    later, as a free Replicate -> Partial of a Replicate ``self`` on a mesh dim where ``src`` is
    not partial would)."""

    def strategy(op_schema: OpSchema) -> OpStrategy:
        theirs = original(op_schema)
        if len(op_schema.args_schema) < 4 or not isinstance(op_schema.args_schema[3], OpStrategy):
            return theirs  # a Python number as src: no tensor to be partial
        rules = [[Replicate()] * 4, [Partial(), Partial(), Replicate(), Partial()]]
        # rows split alike on the other dims, which a Partial mesh dim combines with: on TP-only
        # training's (1, TP) mesh the tokens' Shard(0) stays on the size-1 dim for free, where
        # moving it off first cost more than PyTorch's reduce-scatter on two TP ranks
        self_strategy, dim = op_schema.args_schema[0], op_schema.args_schema[1]
        ndim = self_strategy.ndim if isinstance(self_strategy, OpStrategy) else 0
        rules += [[Shard(d)] * 4 for d in range(ndim) if d != dim % max(ndim, 1)]
        ours = expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema, rules, input_index=1)
        return OpStrategy(list(theirs.strategies) + list(ours.strategies))

    strategy.__wrapped__ = original
    return strategy


def _softmax_backward_with_partial(original):
    """PyTorch's softmax-backward strategies plus, per mesh dim, [grad_in, grad, y] = [P, P, R] and
    the shards of the other dims [S(d), S(d), S(d)] they combine with (the all-Replicate rule first,
    as for scatter)."""

    def strategy(op_schema: OpSchema) -> OpStrategy:
        theirs = original(op_schema)
        grad, y, dim = op_schema.args_schema[:3]
        if not isinstance(grad, OpStrategy) or not isinstance(y, OpStrategy):
            return theirs
        ndim = grad.ndim
        dim = dim % ndim if ndim else 0
        rules = [[Replicate()] * 3, [Partial(), Partial(), Replicate()]]
        rules += [[Shard(d)] * 3 for d in range(ndim) if d != dim]
        ours = expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema, rules, input_index=1)
        return OpStrategy(list(theirs.strategies) + list(ours.strategies))

    strategy.__wrapped__ = original
    return strategy


_WRAPPERS = {
    aten.scatter.src: _scatter_with_partial,
    aten._softmax_backward_data.default: _softmax_backward_with_partial,
}


def install_partial_rules() -> None:
    """Put the Partial strategies beside PyTorch's (idempotent)."""
    table = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    if PATCHES.owners(_OWNER):
        return
    for op, wrap in _WRAPPERS.items():
        if op in table:
            PATCHES.set_item(_OWNER, table, op, wrap(table[op]), f"DTensor strategy {op}")


def uninstall_partial_rules() -> None:
    PATCHES.undo(_OWNER)


