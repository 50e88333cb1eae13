"""DTensor op dispatch as vescale extends it (the paper's section 6.1), in two parts.

``coverage`` (what users' ops need; PyTorch answers differently or not at all):

* ``semantics``: single-device answers where PyTorch's differ (``item()`` of a Partial DTensor is
  the global value; loss means over a split batch).
* ``attention``: sharding rules for the SDPA kernels PyTorch has none for (CPU flash, forward and
  backward); the CUDA fused kernels refuse in-kernel dropout on DTensors (rank-local masks).
* ``conv``: plain tensors meet DTensors as Replicate in convolutions too.
* ``datadep``: data-dependent ops (``nonzero``, masks, ``bincount``, ``unique``, ``index_add_`` /
  ``scatter_add_`` into sharded tensors, fp32 ``_grouped_mm``) with single-device answers.
* ``errors``: an op without a sharding rule names its module, placements and the plan statement
  that avoids it.

``fast`` (the decisions DTensor's own dispatch makes, for less CPU time):

* ``cache``: a sharding cache keyed without sizes, so a new sequence length is a hit; ``zerocost``
  and ``viewkey``: which decisions it may reuse at every size; ``unitdims``: misses on a mesh with
  size-1 dims decided without them.
* ``search``: cheap misses on N-D meshes (the inputs as they are, then PyTorch's priority-queue
  search before its exhaustive expansion).
* ``sized``: a repeated call of an op with size arguments (``view``, ``expand``, ...) replays
  PyTorch's decision from a table instead of DTensor's Python slow path.
* ``unwrap``: a shorter ``unwrap_to_op_info`` for calls of DTensors and scalars; ``pick``:
  Replicate -> Shard narrows to this rank's chunk (PyTorch makes one chunk per rank).
* ``interleaved``, ``partial``, ``viewrule``: strategies that keep tensors local where PyTorch's
  move them (an ``InterleavedShard`` split into its sections; Partial sums through ``scatter`` and
  softmax backward; the view rule's unflatten of a dim split by several mesh dims).

Shared by both: ``metas`` (output metadata by arithmetic, no FakeTensor run), ``local`` (whether
DTensor's rule runs an op on the local shards as they are: Static Eager asks too) and ``scope``
(the handlers answer only for DTensors on vescale's meshes).

``install()`` puts all of them in place, with ``vescale.optim``'s local optimiser steps; ``parallelize``
calls it. Each change goes through ``vescale._torch.PATCHES`` (owners ``dispatch.coverage.*`` and
``dispatch.fast.*``), which ``uninstall()`` undoes. Nothing changes at import.
"""

from .coverage.datadep import DATADEP_OPS, install_datadep_handlers, uninstall_datadep_handlers
from .fast.interleaved import install_interleaved_rules, uninstall_interleaved_rules
from .fast.viewrule import install_view_rule, uninstall_view_rule
from .coverage.attention import install_attention_rules
from .coverage.conv import install_conv_handlers
from .fast.cache import ShapeFreeCache, install_shape_free_cache, shape_free_cache, uninstall_shape_free_cache
from .fast.partial import install_partial_rules, uninstall_partial_rules
from .fast.pick import install_shard_pick, uninstall_shard_pick
from ..optim import ELEMENTWISE_OPTIMIZERS, install_local_optimizer_step, uninstall_local_optimizer_step
from .fast.search import install_fast_search, uninstall_fast_search
from .fast.sized import install_sized_ops, uninstall_sized_ops
from .coverage.semantics import install_semantic_handlers
from .fast.unwrap import install_unwrap, uninstall_unwrap
from vescale._torch import PATCHES


def install() -> None:
    """Install vescale's dispatch extensions into DTensor (idempotent): the op coverage (handlers and
    rules for ops PyTorch answers differently or not at all) and the fast path."""
    install_semantic_handlers()
    install_attention_rules()
    install_conv_handlers()
    install_datadep_handlers()
    install_fast_search()
    install_partial_rules()
    install_shape_free_cache()
    install_local_optimizer_step()
    install_interleaved_rules()
    install_view_rule()
    install_sized_ops()
    install_unwrap()
    install_shard_pick()


def uninstall(keep_learned: bool = False, keep_coverage: bool = False) -> None:
    """Give DTensor back exactly what PyTorch had before ``install()`` (every table entry and
    attribute vescale's dispatch changed, through ``vescale._torch.PATCHES``).
    ``keep_coverage``: keep the op coverage (vescale's answers for ``item()`` of a Partial tensor, the
    CPU SDPA and convolution rules, data-dependent ops) and take only the fast path away: PyTorch's
    own dispatch for ops it can run, as the tests and benchmarks compare with.
    ``keep_learned``: the next ``install()`` resumes with the shape-free cache's decisions (for
    benchmarks that run PyTorch's stack and vescale's in one process, step by step)."""
    uninstall_shard_pick()
    uninstall_unwrap()
    uninstall_sized_ops()
    uninstall_view_rule()
    uninstall_interleaved_rules()
    uninstall_local_optimizer_step()
    uninstall_shape_free_cache(keep_learned)
    uninstall_partial_rules()
    uninstall_fast_search()
    PATCHES.undo("dispatch.fast" if keep_coverage else "dispatch")


def is_installed() -> bool:
    """Whether ``install()`` (directly or through ``parallelize``) is in effect."""
    return bool(PATCHES.owners("dispatch.fast"))


__all__ = [
    "install", "uninstall", "is_installed", "ELEMENTWISE_OPTIMIZERS", "ShapeFreeCache", "install_shape_free_cache",
    "uninstall_shape_free_cache", "shape_free_cache", "install_semantic_handlers", "install_attention_rules",
    "install_datadep_handlers", "uninstall_datadep_handlers", "DATADEP_OPS",
    "install_interleaved_rules", "uninstall_interleaved_rules", "install_sized_ops", "uninstall_sized_ops", "install_fast_search", "uninstall_fast_search",
    "install_partial_rules", "uninstall_partial_rules", "install_view_rule", "uninstall_view_rule",
]
