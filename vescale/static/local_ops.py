"""Local kernels: ops whose DTensor rule is not local, run by a static module on its local shards.

Static Eager mode runs a module on local tensors only where every DTensor op of its body would
have run on the local shards unchanged (``record._why_not_local``). One common op is not: the
*vocabulary-parallel lookup*, ``embedding(weight, ids)`` with the table's rows sharded on a mesh
dim (``Shard(0)``) and the ids whole on it. DTensor's rule for it redistributes the ids to a
``_MaskPartial`` layout (this rank's ids shifted into its rows, the others pointed at row 0 and
remembered in a mask), looks them up in the local rows, and leaves the output ``_MaskPartial``:
the mask zeroes the rows of foreign ids when the output is reduced. That redistribution is local
arithmetic, no communication, and the recorded facts fix it: which parameter is the table, which
mesh dim shards it, and this rank's first row and row count. So the module need not stay eager.

* **Recording** (``masked_lookup``): the recording's op watcher asks, for an op DTensor would not
  run locally, whether it is such a lookup into one of the module's own parameters; if so it keeps
  a ``MaskedLookup`` for that parameter instead of keeping the module eager.
* **Static steps** (``LocalLookups``): while the module's body runs, a ``TorchFunctionMode`` (above
  autograd, so the gradient follows the ops it runs) turns ``F.embedding`` / ``torch.embedding`` on
  that parameter's local tensor into the masked lookup: the ids shifted and masked exactly as
  ``_MaskPartial`` does, the local lookup, and the rows of foreign ids zeroed at once. The output is
  then an ordinary sum-``Partial`` value (one rank holds each row, the others exact zeros), which the
  boundary reduces as it reduces any Partial (``boundary.Move``: reduce-scatter or all-reduce): the
  same values, bit for bit, as ``_MaskPartial``'s own reduction. Backward follows the ops: the
  zeroing drops the foreign rows' gradient and the local lookup's backward sums the rest into this
  rank's rows, which is this rank's slice of the whole table's gradient that eager mode computes
  (each row sums the same terms in the same order, plus exact zeros). That gradient is laid out as
  the table (``Shard(0)`` on the masked mesh dim), not as eager mode's whole-table gradient:
  ``grad_placements`` says so for the runtime's gradient specs.
* **Around it** (``unmasked``, ``unmasked_inputs``): a masked Partial crossing a module boundary in
  static steps was made by this kernel, so its spec is recorded as the plain Partial it is; a
  masked Partial made by an *eager* module (its local tensor not yet masked) must not reach a
  static body, so the module it would reach stays eager.

The first static step (the runtime's checking watcher) checks that every lookup into a recorded
table went through the kernel (``check_lookup``): a model that reaches the op some other way fails
with the module named instead of reading foreign rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from vescale._torch import DTensorSpec, _MaskPartial, exit_function_mode
from torch.overrides import TorchFunctionMode

from ..dispatch.local import moves_data
from ..plan.ir import PlanError
from ..placement.blocks import local_shape_and_offset

__all__ = ["MaskedLookup", "LocalLookups", "masked_lookup", "grad_placements", "is_masked", "unmasked", "unmasked_inputs", "check_lookup"]

aten = torch.ops.aten


@dataclass(frozen=True)
class MaskedLookup:
    """A recorded vocabulary-parallel table: the module's parameter ``param``, its rows sharded on
    ``mesh_dim``; this rank holds rows ``offset .. offset + rows`` of ``vocab``."""

    param: str
    mesh_dim: int
    offset: int
    rows: int
    vocab: int

    def __call__(self, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int) -> torch.Tensor:
        """``embedding(weight, ids)`` of the whole table, as this rank's share of a sum: its rows
        looked up, every other id's row zero. ``padding_idx``: a global row (negative: none)."""
        if weight.shape[0] != self.rows:
            raise PlanError(
                f"parameter {self.param!r} has {weight.shape[0]} local rows in a static step but {self.rows} "
                f"when it was recorded; the table changed after recording"
            )
        # As _MaskPartial._mask_tensor shifts and masks them, so the lookups read the same rows.
        foreign = (ids < self.offset) | (ids >= self.offset + self.rows)
        local_ids = ids - self.offset
        local_ids.masked_fill_(foreign, 0)
        out = torch.embedding(weight, local_ids, self._local_padding(padding_idx), False, False)
        # MaskBuffer.apply_mask zeroes these rows (to +0.0) before the reduction; here, at once.
        return out.masked_fill(foreign.unsqueeze(-1), 0.0)

    def _local_padding(self, padding_idx: int) -> int:
        """The padding row (a global row; negative: none) as a row of this rank's shard, or -1."""
        local = padding_idx - self.offset
        return local if padding_idx >= 0 and 0 <= local < self.rows else -1


# ---------------------------------------------------------------------------------------------
# Recording: is this op a lookup the kernel can run?
# ---------------------------------------------------------------------------------------------


def _embedding_args(args, kwargs) -> tuple:
    """``aten.embedding`` arguments as (weight, ids, padding_idx, scale_grad_by_freq, sparse)."""
    names = ("weight", "indices", "padding_idx", "scale_grad_by_freq", "sparse")
    defaults = (None, None, -1, False, False)
    values = list(args) + [kwargs.get(n, d) for n, d in zip(names[len(args):], defaults[len(args):])]
    return tuple(values)


def masked_lookup(func: Callable[..., Any], args: tuple, kwargs: dict, params: dict) -> MaskedLookup | None:
    """The ``MaskedLookup`` of ``func`` if it is ``aten.embedding`` into one of ``params`` (the
    module's parameters, name -> tensor as the body sees it) whose only non-local step is DTensor's
    masked-Partial rule on one mesh dim; None otherwise (the op keeps its module eager)."""
    if func is not aten.embedding.default:
        return None
    weight, ids, padding_idx, scale_grad_by_freq, sparse = _embedding_args(args, kwargs)
    # A frequency-scaled gradient divides by per-row id counts, which row 0 of the masked ids would
    # inflate; a sparse gradient has no local counterpart here.
    if scale_grad_by_freq or sparse or not isinstance(weight, DTensor) or weight.ndim != 2:
        return None
    name = next((n for n, p in params.items() if p is weight), None)
    if name is None:
        return None
    mesh_dim = _masked_dim(func, args, kwargs, weight, ids)
    if mesh_dim is None:
        return None
    local_shape, offset = local_shape_and_offset(weight.shape, weight.device_mesh, weight.placements)
    if local_shape[0] != weight._local_tensor.shape[0]:
        return None
    return MaskedLookup(name, mesh_dim, int(offset[0]), int(local_shape[0]), int(weight.shape[0]))


def _masked_dim(func, args, kwargs, weight: DTensor, ids) -> int | None:
    """The one mesh dim where DTensor's rule masks the lookup (the table ``Shard(0)``, the ids whole,
    the output ``_MaskPartial``), if every other mesh dim runs it on the local shards as they are."""
    dispatcher = DTensor._op_dispatcher
    try:
        info = dispatcher.unwrap_to_op_info(func, args, kwargs)
        sharding = dispatcher.sharding_propagator.propagate_op_sharding(info.schema)
    except Exception:  # no decision: DTensor itself reports it when the op runs
        return None
    out = sharding.output_spec
    if not isinstance(out, DTensorSpec):
        return None
    masked = [i for i, p in enumerate(out.placements) if isinstance(p, _MaskPartial)]
    if len(masked) != 1:
        return None
    m = masked[0]
    mesh = weight.device_mesh
    for i, p in enumerate(weight.placements):
        # Rows sharded on the masked dim alone, evenly or not: the offset is the one _MaskPartial computes.
        shards_rows = p.is_shard() and p.dim in (0, -2)
        if (i == m and not (type(p) is Shard and shards_rows)) or (i != m and shards_rows and mesh.size(i) > 1):
            return None
    ids_placements = ids.placements if isinstance(ids, DTensor) else (Replicate(),) * mesh.ndim
    if not ids_placements[m].is_replicate():
        return None
    # Nothing else moves: the table stays as it is, and the ids move only on the masked dim.
    schema = sharding.redistribute_schema
    if schema is not None:
        for have, want in zip(info.schema.args_schema, schema.args_schema):
            if not isinstance(have, DTensorSpec) or not moves_data(have, want):
                continue
            moved = [i for i, (a, b) in enumerate(zip(have.placements, want.placements)) if a != b and mesh.size(i) > 1]
            if have is not info.schema.args_schema[1] or moved != [m]:
                return None
    return m


# ---------------------------------------------------------------------------------------------
# Static steps
# ---------------------------------------------------------------------------------------------


class LocalLookups(TorchFunctionMode):
    """Entered while a static module's body runs (``enter`` / ``exit``): lookups into its recorded
    tables run masked; every other function passes straight through."""

    def __init__(self, lookups: dict):
        super().__init__()
        self.lookups = lookups  # parameter name -> MaskedLookup
        self.module = None
        self.running = False  # a kernel's own lookup is on its way (check_lookup lets it through)

    def enter(self, module: torch.nn.Module) -> None:
        self.module = module
        self.__enter__()

    def exit(self) -> None:
        self.module = None
        # Wherever it is on the stack: the random gate of the same body may sit above it.
        exit_function_mode(self)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding:
            ids, weight, padding_idx, rest = _functional_args(args, kwargs)
        elif func is torch.embedding:
            weight, ids, padding_idx, *flags = _embedding_args(args, kwargs)
            rest = {"scale_grad_by_freq": flags[0], "sparse": flags[1]}
        else:
            return func(*args, **kwargs)
        lookup = self._table(weight)
        if lookup is None:
            return func(*args, **kwargs)
        if rest.get("max_norm") is not None or rest.get("scale_grad_by_freq") or rest.get("sparse"):
            raise PlanError(
                f"a lookup into {lookup.param!r} asks for {rest} in a static step, which its recorded lookup did not; "
                f"keep the module on DTensors with plan.eager(...)"
            )
        if func is F.embedding and padding_idx is not None and padding_idx < 0:
            padding_idx += lookup.vocab  # F.embedding counts a negative padding row from the table's end
        self.running = True
        try:
            return lookup(ids, weight, -1 if padding_idx is None else padding_idx)
        finally:
            self.running = False

    def _table(self, weight) -> MaskedLookup | None:
        params: dict = self.module._parameters if self.module is not None else {}
        for name, lookup in self.lookups.items():
            if params.get(name) is weight:
                return lookup
        return None


def _functional_args(args, kwargs) -> tuple:
    """``F.embedding`` arguments as (ids, weight, padding_idx, the other options)."""
    names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
    defaults = (None, None, None, None, 2.0, False, False)
    values = dict(zip(names, defaults))
    values.update(zip(names, args))
    values.update(kwargs)
    ids, weight, padding_idx = values.pop("input"), values.pop("weight"), values.pop("padding_idx")
    return ids, weight, padding_idx, values


def check_lookup(lookups: dict, steps: dict, module: str, func: Callable[..., Any]) -> None:
    """First static step: an ``aten.embedding`` in a module with recorded tables must come from
    the kernel (``steps``: module path -> its ``program.Steps``, whose ``lookups`` is its LocalLookups)."""
    if func is not aten.embedding.default or module not in lookups:
        return
    mode = getattr(steps.get(module), "lookups", None)
    if mode is None or not mode.running:
        raise PlanError(
            f"module {module!r}: aten.embedding.default reached a vocabulary-sharded table in a static step "
            f"without going through F.embedding / torch.embedding, where Static Eager masks it; keep the module "
            f"on DTensors with plan.eager({module!r})"
        )


# ---------------------------------------------------------------------------------------------
# Around the kernel: boundary specs and gradient layouts
# ---------------------------------------------------------------------------------------------


def unmasked(spec: DTensorSpec | None) -> DTensorSpec | None:
    """``spec`` with each ``_MaskPartial`` placement as the plain ``Partial`` it is in static steps
    (the kernel masked its rows already); other specs unchanged."""
    if spec is None or not any(isinstance(p, _MaskPartial) for p in spec.placements):
        return spec
    placements = tuple(Partial(p.reduce_op) if isinstance(p, _MaskPartial) else p for p in spec.placements)
    return DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)


def is_masked(spec: DTensorSpec | None) -> bool:
    return spec is not None and any(isinstance(p, _MaskPartial) for p in spec.placements)


def grad_placements(lookups: dict | None, module: str, name: str, param: DTensor, recorded: tuple | None) -> tuple | None:
    """The placements of ``module.name``'s gradient in static steps: as recorded, except on the
    masked mesh dim of a recorded table, where the kernel's gradient is laid out as the table."""
    lookup = (lookups or {}).get(module, {}).get(name)
    if lookup is None or recorded is None:
        return recorded
    m, own = lookup.mesh_dim, param.placements[lookup.mesh_dim]
    if not (recorded[m].is_replicate() or recorded[m] == own):
        raise PlanError(
            f"the gradient of {module}.{name} was {tuple(recorded)} when recorded: besides its "
            f"vocabulary-parallel lookup the module uses it in a way whose gradient static mode cannot lay out "
            f"as the table; keep it on DTensors with plan.eager({module!r})"
        )
    return tuple(own if i == m else p for i, p in enumerate(recorded))


def unmasked_inputs(masked: set, parent: dict, eager: set) -> dict:
    """Modules that would get a masked Partial from an eager module (whose local tensor still holds
    row 0 where the mask says zero): path -> why it stays eager. ``masked``: the recorded crossing
    keys that held a masked Partial; ``eager``: the modules the recording ran eagerly."""
    unsafe = {}
    why = "would get a masked Partial (an unreduced vocabulary-parallel lookup) from an eager module"
    # Found in every recording, as a module's own non-local op is, so that the module is reported
    # (export_plan) once it is eager too.
    for path, where, _ in masked:
        if where == "body" and parent.get(path) in eager | {None}:
            unsafe[path] = why
        elif where == "result" and path in eager and parent.get(path) is not None:
            unsafe[parent[path]] = f"{why} ({path!r})"
    return unsafe
