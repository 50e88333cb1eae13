"""Whether DTensor's own sharding rule would run an op on the local shards as they are.

Static Eager mode (``vescale.static``) runs a module on plain local tensors only where every DTensor
op of the module would have run on the local shards unchanged; custom handlers (``datadep``) that
defer to DTensor's rule ask the same question. The answer comes from DTensor's propagation: the op
is local when the chosen strategy moves no input. Two kinds of "moves" change nothing on the local
tensors and do not count: size arguments rewritten from global to local sizes (checked separately
by the caller), and placement changes on mesh dims of size 1 (DP=1 in a (DP, TP) mesh, say).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from vescale._torch import DTensorSpec, OpSchema, OutputSharding

__all__ = ["why_rule_not_local", "data_moves", "moves_data", "decisions_remembered", "remember_decision",
           "runs_locally_when", "handler_runs_locally"]

# vescale's custom op handlers that compute on the local shards as they are, under a condition:
# handler -> predicate(op, args, kwargs). Static Eager asks before it runs a module on local tensors.
_RUNS_LOCALLY_WHEN: dict = {}


def runs_locally_when(handler: Callable, predicate: Callable[..., Any]) -> None:
    """Declare that ``handler`` computes on the local shards as they are whenever
    ``predicate(op, args, kwargs)`` is true (a handler not declared never does)."""
    _RUNS_LOCALLY_WHEN[handler] = predicate


def handler_runs_locally(handler: Callable, op: Any, args: tuple, kwargs: dict | None) -> bool:
    """Whether ``handler`` (a DTensor custom op handler) runs this call on the local shards as they are."""
    predicate = _RUNS_LOCALLY_WHEN.get(handler)
    return predicate is not None and predicate(op, args, kwargs)


def moves_data(src: DTensorSpec, dst: DTensorSpec) -> bool:
    """Whether redistributing spec ``src`` to ``dst`` changes local tensors."""
    mesh = src.mesh
    return any(p != q and mesh.size(i) > 1 for i, (p, q) in enumerate(zip(src.placements, dst.placements)))


def data_moves(func: Any, args: tuple, kwargs: dict | None) -> list:
    """The inputs DTensor's own rule for ``func`` would redistribute in a way that changes their
    local tensors: ``[(argument index, spec, target spec), ...]`` (empty: the op runs on the local
    shards as they are). Raises where DTensor has no decision for the call."""
    dispatcher = DTensor._op_dispatcher
    info = dispatcher.unwrap_to_op_info(func, args, kwargs)
    sharding = _remembered.get(info.schema) if _remembered is not None else None
    if sharding is None:
        sharding = dispatcher.sharding_propagator.propagate_op_sharding(info.schema)
    if not sharding.needs_redistribute:
        return []
    pairs = enumerate(zip(info.schema.args_schema, sharding.redistribute_schema.args_schema))
    return [(i, a, b) for i, (a, b) in pairs if hasattr(a, "placements") and moves_data(a, b)]


def why_rule_not_local(func: Any, args: tuple, kwargs: dict | None) -> str | None:
    """None if DTensor's own rule for ``func`` runs it on the local shards as they are, else why not."""
    try:
        moves = data_moves(func, args, kwargs)
    except Exception as e:  # DTensor itself will report it when the op runs
        return f"{func} has no sharding decision ({type(e).__name__})"
    return f"{func} needs its inputs redistributed" if moves else None


# op schema -> the sharding decision made for it, while ``decisions_remembered`` is open (else None)
_remembered: dict | None = None


def remember_decision(op_schema: OpSchema, sharding: OutputSharding) -> None:
    """Keep a decision made below DTensor's own caches (the shape-free cache, ``cache.py``, reports
    each one it makes) while ``decisions_remembered`` is open."""
    if _remembered is not None:
        _remembered[op_schema] = sharding


@contextlib.contextmanager
def decisions_remembered() -> Iterator[None]:
    """While open, DTensor's sharding decisions made below its own caches are kept
    (``remember_decision``), and ``why_rule_not_local`` for an op that already ran takes its
    decision from there: DTensor's C++ cache and the Python propagator's LRU are separate, so asking
    the propagator again after the op ran would search the op's strategies a second time (Static
    Eager's recording asks for every op). Nested blocks leave the decisions to the outermost."""
    global _remembered
    if _remembered is not None:
        yield
        return
    _remembered = {}
    try:
        yield
    finally:
        _remembered = None
