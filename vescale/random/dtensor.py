"""Random ops on DTensors with single-device semantics (the paper's Algorithm 1).

Each rank fills only its own shard, but every element gets the value the element with the same
*global* index gets on a single device: the rank computes, per tensor dimension, the global indices
its shard holds (with DTensor's own sharding code, so uneven, empty and ``_StridedShard`` shards
follow DTensor exactly) and asks the kernel for exactly those elements. Replicate and Partial mesh
dimensions draw the same values on every rank; a Partial input of a random op becomes Replicate
(its values are reduced first where the op reads them, as DTensor's own rules would do).

Two entry points reach this code, both installed by :func:`install` (never at import):

* handlers in ``DTensor._op_dispatcher._custom_op_handlers`` for every supported aten random op
  (and raising ones for the unsupported distribution ops), and
* :class:`VescaleRNGTracker`, installed as DTensor's RNG tracker, whose ``_distribute_region`` is
  where ``torch.distributed.tensor.rand/randn`` build their local shard.

:func:`install` also installs vescale.dispatch's semantic handlers: random code with a
data-dependent loop (``nn.init.trunc_normal_`` redraws until ``not mask.any()``) needs ``item()``
of a Partial DTensor to be the global value on every rank, not PyTorch's local one, or the ranks
stop at different iterations and their generators fall out of step.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Sequence

import torch
from vescale._torch import dtensor_random, DTensorSpec, TensorMeta, PATCHES
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Partial

from vescale.dispatch import install_semantic_handlers
from vescale.dispatch.scope import for_vescale_meshes, mesh_of_call, pytorch_handling
from vescale.memo import Memo
from vescale.mesh import is_vescale_mesh
from vescale.dispatch.metas import contiguous_strides
from vescale.placement.blocks import dim_ranges
from vescale.random import kernel, ops

__all__ = ["VescaleRNGTracker", "install", "uninstall", "is_installed", "local_indices", "handle_random_op", "draw_shard"]


# ---- which global elements a rank holds ------------------------------------------------------------------


def _placements_in_shard_order(spec: DTensorSpec):
    # A spec may carry a non-default shard order (tensor dim sharded over mesh dims in another order);
    # DTensor's own conversion expresses it as _StridedShard placements applied left to right.
    if spec.use_strided_shard_as_shard_order:
        return spec.placements
    if spec.shard_order == DTensorSpec.compute_default_shard_order(spec.placements):
        return spec.placements
    return DTensorSpec._convert_shard_order_to_StridedShard(spec.shard_order, spec.placements, spec.mesh)


def local_indices(spec: DTensorSpec, coordinate: Sequence[int] | None = None) -> list[torch.Tensor] | None:
    """Per tensor dimension, the global indices (int64, in local order) of the block held at mesh
    ``coordinate`` (default: this rank's), or None when this rank is not in the mesh.

    DTensor's layout by arithmetic (``vescale.placement.blocks.dim_ranges``: each placement's own
    split, in the order ``distribute_tensor`` applies them, checked against DTensor's index tensors),
    so the cost does not grow with the mesh dims' sizes."""
    coordinate = spec.mesh.get_coordinate() if coordinate is None else coordinate
    if coordinate is None:
        return None
    placements = _placements_in_shard_order(spec)
    mesh_shape = tuple(spec.mesh.shape)
    indices = []
    for dim, size in enumerate(spec.shape):
        ranges = dim_ranges(size, dim, mesh_shape, coordinate, placements)
        if len(ranges) == 1:
            indices.append(torch.arange(ranges[0][0], ranges[0][0] + ranges[0][1], dtype=torch.int64))
        else:
            indices.append(torch.cat([torch.arange(s, s + n, dtype=torch.int64) for s, n in ranges])
                           if ranges else torch.zeros(0, dtype=torch.int64))
    return indices


def _result_spec(spec: DTensorSpec, dtype: torch.dtype, tensor_meta: TensorMeta | None = None) -> DTensorSpec:
    """The spec of a random result drawn over ``spec``'s tensor: Partial mesh dims become Replicate
    (every rank there holds the same values), the rest is kept. A new tensor is contiguous unless
    ``tensor_meta`` (an in-place op's own) says otherwise."""
    placements = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
    shape = spec.shape
    return DTensorSpec(
        spec.mesh,
        placements,
        tensor_meta=tensor_meta or TensorMeta(shape, contiguous_strides(shape), dtype),
        shard_order=None if spec.use_strided_shard_as_shard_order else spec.shard_order,
        use_strided_shard_as_shard_order=spec.use_strided_shard_as_shard_order,
    )


class _SpecPlan:
    """What a random op over a DTensor spec needs that depends only on the spec and this rank's mesh
    coordinate: the result placements, the result spec per dtype and this rank's kernel.Block (indices,
    scans, kernel layout). Nothing here depends on the op's values or the generator state, so one plan
    serves every call over the same spec (the same specs recur every training step)."""

    def __init__(self, spec: DTensorSpec, coordinate):
        # A private spec of our own: later changes to the caller's spec object cannot reach the plan.
        self.base = _result_spec(spec, spec.tensor_meta.dtype if spec.tensor_meta else torch.float32)
        self.placements = self.base.placements
        self.shape = self.base.shape
        self.dim_indices = local_indices(self.base, coordinate)
        self.block = None if self.dim_indices is None else kernel.Block(self.shape, self.dim_indices)
        self.local_shape = self.block.shape if self.block is not None else (0,)
        self._result_specs: dict[torch.dtype, DTensorSpec] = {}

    def result_spec(self, dtype: torch.dtype) -> DTensorSpec:
        """The spec of a contiguous ``dtype`` result; one object per dtype, shared by all results (DTensor's
        own sharding propagation shares output specs the same way: specs are never modified in place)."""
        spec = self._result_specs.get(dtype)
        if spec is None:
            spec = self._result_specs[dtype] = _result_spec(self.base, dtype)
        return spec


_plans = Memo("random-op spec plans", 1024)  # (spec, coordinate) pairs; a model has a few dozen


def _plan_of(spec: DTensorSpec) -> _SpecPlan:
    """The cached plan of ``spec`` at this rank's coordinate. The key holds every input of the plan (mesh,
    placements, shard order and its form, global shape, coordinate) and nothing that changes between
    calls (dtype and strides only select a result spec inside the plan)."""
    coordinate = spec.mesh.get_coordinate()
    key = (
        spec.mesh,
        spec.placements,
        spec.shard_order,
        spec.use_strided_shard_as_shard_order,
        spec.shape,
        None if coordinate is None else tuple(coordinate),
    )
    return _plans.get_or_make(key, lambda: _SpecPlan(spec, coordinate))


def clear_plan_cache() -> None:
    """Forget every cached plan (tests compare cached and freshly built plans with it)."""
    _plans.clear()


def _local_operand(tensor, plan: _SpecPlan) -> torch.Tensor:
    """The values of ``tensor`` (broadcast to the plan's shape) at this rank's block."""
    shape = tuple(plan.shape)
    if isinstance(tensor, DTensor):
        if tuple(tensor.shape) == shape and tensor.device_mesh == plan.base.mesh:
            own = tensor._spec
            if own.placements == plan.placements and own.shard_order == plan.base.shard_order:
                return tensor._local_tensor  # already laid out as the result: nothing to move
            return tensor.redistribute(plan.base.mesh, plan.placements).to_local()
        tensor = tensor.full_tensor()  # broadcast operand or another mesh: rare, so simply gather it
    return ops.select_block(tensor, shape, plan.dim_indices)


# ---- the handlers -----------------------------------------------------------------------------------------


def _pytorch_random_op(op, args, kwargs):
    """A random op on a DTensor over a mesh vescale was not given: PyTorch's own handling with
    PyTorch's own RNG tracker, as without vescale (said once per mesh)."""
    warnings.warn(
        f"vescale.random: random ops on DTensors over {mesh_of_call(args, kwargs)} draw PyTorch's numbers "
        "(as without vescale), not vescale's single-device ones: vescale was not given this mesh. For "
        "vescale's, build it with vescale.init_mesh, parallelize a model on it, or call vescale.adopt_mesh(mesh).",
        stacklevel=2,
    )
    with PATCHES.original("attr", dtensor_random, "_rng_tracker"):
        return pytorch_handling(op, args, kwargs)


def draw_shard(op: Any, args: tuple, kwargs: dict | None) -> object:
    """Draw this rank's shard of a random op's DTensor result, with single-device values."""
    call = ops.read_call(op, args, kwargs or {})
    if call.generator is not None:
        raise ValueError(
            f"vescale.random: {op} on a DTensor was given generator={call.generator!r}. Random ops on "
            "DTensors draw from vescale's generator (vescale.manual_seed) so that every rank agrees with a "
            "single device; a torch.Generator cannot provide that. Remove the generator argument."
        )
    source = call.target if call.target is not None else call.like
    if not isinstance(source, DTensor):
        raise TypeError(f"vescale.random: {op} expected a DTensor self/input, got {type(source).__name__}")
    plan = _plan_of(source._spec)
    if call.dropout_scale is not None:
        return _dropout(call, plan)
    prob = None if call.prob is None else _local_operand(call.prob, plan)
    if call.target is not None:
        ops.fill(source._local_tensor, call, plan.shape, plan.block, prob)
        if plan.placements != source._spec.placements:  # Partial dims now hold the same values: Replicate
            source._spec = _result_spec(source._spec, source.dtype, source._spec.tensor_meta)
        return source
    device = call.device or source._local_tensor.device
    local = torch.empty(plan.local_shape, dtype=call.dtype, device=device)
    ops.fill(local, call, plan.shape, plan.block, prob)
    return DTensor(local, plan.result_spec(call.dtype), requires_grad=False)


# DTensor's handler for every op in ``ops.SUPPORTED`` (vescale's meshes; PyTorch's rule elsewhere)
handle_random_op = for_vescale_meshes(draw_shard, elsewhere=_pytorch_random_op)


def _dropout(call: ops.RandomCall, plan: _SpecPlan):
    x = call.like
    x_local = _local_operand(x, plan) if plan.block is not None else x._local_tensor
    if call.train:
        mask = torch.empty(x_local.shape, dtype=torch.float32, device=x_local.device)
        ops.fill(mask, call, plan.shape, plan.block)
        output, mask = ops.dropout_output(x_local, mask, call.dropout_scale)
    else:
        output, mask = x_local.clone(), torch.ones_like(x_local, dtype=torch.bool)
    return (
        DTensor(output, plan.result_spec(x.dtype), requires_grad=False),
        DTensor(mask, plan.result_spec(torch.bool), requires_grad=False),
    )


@for_vescale_meshes(elsewhere=_pytorch_random_op)
def _refuse_unsupported(op, args, kwargs):
    raise ops.unsupported_error(op)


# ---- DTensor factories: torch.distributed.tensor.rand / randn --------------------------------------------


class _ShardBlock:
    """RandomOpMode block for a DTensor factory: the op's tensor is this rank's shard of ``spec``."""

    def __init__(self, spec: DTensorSpec):
        self.spec = spec
        self.plan = _plan_of(spec)

    def __call__(self, local_shape):
        expected = list(self.plan.local_shape)
        if list(local_shape) != expected:
            raise RuntimeError(
                f"vescale.random: a random op inside a DTensor factory region built a tensor of shape "
                f"{list(local_shape)}, but this rank's shard of {list(self.spec.shape)} with placements "
                f"{self.spec.placements} has shape {expected}"
            )
        return tuple(self.spec.shape), self.plan.block


def _pytorch_tracker(mesh):
    """The RNG tracker PyTorch would use for a DTensor factory on ``mesh``: its own if it made one,
    else the one its factories make on first use where the device supports it (kept for next time)."""
    with PATCHES.original("attr", dtensor_random, "_rng_tracker"):
        if dtensor_random._rng_tracker is None and dtensor_random.is_rng_supported_mesh(mesh):
            dtensor_random._rng_tracker = dtensor_random.OffsetBasedRNGTracker(mesh)
        return dtensor_random._rng_tracker


class VescaleRNGTracker(dtensor_random._RNGStateTracker):
    """DTensor RNG tracker whose region draws the local shard of a factory from vescale's generator."""

    def __init__(self):
        # The tracker holds no device state (vescale's generator is device independent); "cpu" always
        # satisfies the base class's device check.
        super().__init__(torch.device("cpu"))

    @contextlib.contextmanager
    def _distribute_region(self, spec: DTensorSpec, generator: torch.Generator | None = None):
        if generator is not None:
            raise ValueError(
                "vescale.random: DTensor random ops draw from vescale's generator; a torch.Generator "
                f"({generator!r}) cannot give single-device semantics. Remove the generator argument."
            )
        if any(isinstance(p, Partial) for p in spec.placements):
            raise ValueError(
                f"vescale.random: a random DTensor factory with Partial placements {spec.placements} has no "
                "single-device meaning (the ranks' values would be summed). Use Replicate() instead."
            )
        if not self.distribute_region_enabled:
            yield
            return
        pytorch = None if is_vescale_mesh(spec.mesh) else _pytorch_tracker(spec.mesh)
        if pytorch is not None:  # another program's mesh: PyTorch's tracker, as without vescale
            with pytorch._distribute_region(spec, generator):
                yield
            return
        # vescale's mesh, or one PyTorch has no tracker for (its factories refuse CPU meshes): vescale's numbers
        with ops.RandomOpMode(_ShardBlock(spec)):
            yield

    def _manual_seed(self, parallel_seed: int) -> None:
        raise RuntimeError("vescale.random: seed vescale's generator with vescale.manual_seed(seed)")


# ---- installation ------------------------------------------------------------------------------------------

_OWNER = "random"


def _handlers() -> dict:
    table = {op: handle_random_op for op in ops.SUPPORTED}
    table.update({op: _refuse_unsupported for op in ops.UNSUPPORTED})
    return table


def install() -> None:
    """Route DTensor random ops through vescale's generator (idempotent; vescale.manual_seed calls it)."""
    if is_installed():
        return
    custom = DTensor._op_dispatcher._custom_op_handlers
    for op, handler in _handlers().items():
        PATCHES.set_item(_OWNER, custom, op, handler, f"DTensor custom handler {op}")
    PATCHES.set_attr(_OWNER, dtensor_random, "_rng_tracker", VescaleRNGTracker())
    install_semantic_handlers(_OWNER)  # global item(): trunc_normal_'s loop condition agrees across ranks


def uninstall() -> None:
    """Undo :func:`install`: DTensor random ops go back to PyTorch's own RNG handling."""
    PATCHES.undo(_OWNER)


def is_installed() -> bool:
    return bool(PATCHES.owners(_OWNER))
