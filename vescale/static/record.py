"""Static Eager's recording: what the first eager step of an input-shape key notes.

``Record`` holds it (per boundary spot, the ``Crossing``: the DTensor spec that crossed and its
gradient's placements; parameters' gradient layouts; modules that must stay eager and why; sized
ops' local shapes; random ops' specs) and, once its first static step begins, the program those
steps run (``program``: every module's ``Steps``, decided by ``program.py``).
``_OpWatcher`` is the ``TorchDispatchMode`` of the recording step: it asks DTensor's own decision
(``vescale.dispatch.local``) whether a module's op would communicate or draw random numbers, and
of the first static step, whose local shapes it checks against the recorded ones.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from vescale._torch import DTensorSpec, TorchDispatchMode

from ..dispatch.local import data_moves, handler_runs_locally, why_rule_not_local
from ..parallel.faults import _first_line
from ..plan.ir import PlanError
from . import averaged, resize
from .local_ops import check_lookup, is_masked, masked_lookup, unmasked
from .shares import SUMS, GradientShares

__all__ = ["Crossing", "Record", "input_keys", "output_keys"]


@dataclass
class Crossing:
    """What one tensor position at a boundary held in the recording step."""

    spec: DTensorSpec | None = None  # DTensorSpec, or None for a plain (global) tensor
    grad_placements: tuple | None = None  # placements its gradient arrived in
    # Where a plan.redistribute states grad_dst: the placements the gradient leaves here in (full
    # mesh); None: DTensor's default (the forward placements with Partial as Replicate).
    leave_grad: tuple | None = None
    # Gradient specs, made once in the first static step: for a local tensor wrapped here (the
    # default layout, as the recording step's _mirror had it) and for a DTensor unwrapped here.
    wrap_grad: DTensorSpec | None = None
    unwrap_grad: DTensorSpec | None = None
    # What the wrap divides the local gradient by: the ranks an averaged Partial averages over
    # (``vescale.static.averaged``), 1 otherwise; set with wrap_grad.
    wrap_divisor: int = 1
    # In a record derived for new input sizes (resize.py): the recorded spec with its sizes open,
    # settled (and ``spec`` replaced) by the first tensor crossing here.
    pending: resize.Pending | None = None


@dataclass
class Record:
    """Everything recorded for one set of root input shapes."""

    crossings: dict = field(default_factory=dict)  # (module, where, index) -> Crossing
    param_grads: dict = field(default_factory=dict)  # (module, name) -> grad placements
    unsafe: dict = field(default_factory=dict)  # module path -> why its own ops need DTensor
    shapes: dict = field(default_factory=dict)  # module path -> local output shapes of sized ops
    random: dict = field(default_factory=dict)  # module path -> per random op, its args' specs
    assumed_eager: frozenset = frozenset()  # modules this recording ran as if they were eager
    complete: bool = False  # its backward has finished
    checked: bool = False  # a static step has run (and checked its shapes) with it
    moves: dict = field(default_factory=dict)  # (module, "in" | "out") -> [Move | None] or None
    param_grad_specs: dict = field(default_factory=dict)  # (module, name) -> spec of its gradient
    shared_grad_specs: dict = field(default_factory=dict)  # gradient spec -> the one object of that value
    # (module, "in" | "out") -> the plan key of each tensor crossing there, in crossing order
    # (argument name or position, output index or field; None inside a nested container)
    keys: dict = field(default_factory=dict)
    # Module path -> its program.Steps: what its hooks do in static steps, for every module of the model,
    # decided when the first static step begins (program.decide); None until then.
    program: Mapping | None = None
    # Module path -> module, for the modules whose hooks have nothing to do in this record's static
    # steps (see program.find_quiet); None until the first static step has run.
    quiet: dict | None = None
    # module path -> {parameter name: MaskedLookup}: vocabulary-parallel lookups its body runs
    # masked on local tensors in static steps (local_ops.py)
    lookups: dict = field(default_factory=dict)
    masked: set = field(default_factory=set)  # crossing keys that held a masked Partial (local_ops.unmasked_inputs)
    # module path -> per F.cross_entropy call of its body, the LocalLoss its static steps run (None:
    # the call as it is; local_loss.py)
    losses: dict = field(default_factory=dict)
    # module path -> per view / reshape / split call of its body, the SizeRewrite its static steps
    # apply (None: the call as it is; local_sizes.py); bodies with no rewrite are dropped once known
    sizes: dict = field(default_factory=dict)
    # module path -> the call site of each of those calls (local_calls.call_site), in the same order:
    # a static step matches a call to its note by site, not by position in the body
    size_sites: dict = field(default_factory=dict)
    # The torch functions its drawing bodies' random ops come from (random_gate.py): None until the
    # first static step has learnt them; empty where they cannot be told (the replay then watches
    # whole drawing bodies).
    random_funcs: frozenset | None = None
    # module path -> an op of its body whose output size depends on values (no record is derived from this one)
    data_dependent: dict = field(default_factory=dict)
    verified: bool = False  # its first static step's forward ran through (checked)
    # ZeRO-3 units run as one (see StaticRuntime.unit_in): unit -> [(path, module, gather entries)] of
    # its quiet members, set with ``quiet``; and the units the recording found must not (why).
    quiet_units: dict | None = None
    units_off: dict = field(default_factory=dict)
    unit_reached: set = field(default_factory=set)  # recording: units whose output gradient arrived
    member_calls: dict = field(default_factory=dict)  # recording: member path -> calls this step
    resized_from: "Record | None" = None  # derived from this recorded record for other input sizes (resize.py)
    # The batch-local modules whose hooks its static steps replace by relabels (relabel.py); None
    # until its first static step.
    relabelled: frozenset | None = None
    # Recording: which gradient each body hands back, read off autograd's nodes (shares.py); dropped
    # once its backward has run.
    shares: GradientShares | None = None
    # Static steps' recomputations (recompute.py): hooked caller -> its quiet callees (path, module),
    # made at the first recomputation.
    quiet_callers: dict | None = None

    def note(self, parent: dict, key: tuple, t: torch.Tensor) -> Crossing:
        """Record what crossed at ``key``. A module called more than once per step with differently
        placed tensors at the same spot cannot be replayed from one record: it and its caller stay
        eager (then its inputs arrive as DTensors and need no recorded spec). ``parent``: path ->
        caller path."""
        spec = _spec_of(t)
        if is_masked(spec):
            # In static steps this tensor comes from a masked lookup's kernel: a plain Partial sum.
            self.masked.add(key)
            spec = unmasked(spec)
        c = self.crossings.get(key)
        if c is None:
            c = self.crossings[key] = Crossing(spec)
        elif c.spec != spec:
            self.keep_eager(parent, key[0], "called more than once per step with differently placed tensors")
        return c

    def keep_eager(self, parent: dict, path: str, why: str) -> None:
        """Keep ``path`` and its caller on DTensors."""
        self.unsafe.setdefault(path, why)
        if parent.get(path) is not None:
            self.unsafe.setdefault(parent[path], f"calls {path!r}: {why}")



# ---------------------------------------------------------------------------------------------
# Which ops cannot run on local shards
# ---------------------------------------------------------------------------------------------


def _why_not_local(func, args, kwargs) -> str | None:
    """None if DTensor would run ``func`` on the local shards as they are (size arguments aside,
    see ``_SIZED``), else the reason."""
    dispatcher = DTensor._op_dispatcher
    handler = dispatcher._custom_op_handlers.get(func)
    if handler is not None:
        # A handler may say when it computes on the local shards as they are (vescale's SDPA does).
        if handler_runs_locally(handler, func, args, kwargs):
            return None
        return f"{func} has a custom DTensor handler"
    return why_rule_not_local(func, args, kwargs)


_aten = torch.ops.aten
# Autograd nodes whose backward formula makes fresh zeros and puts the gradient into them, and the
# ops that do so: ``index``'s (``index_put(zeros, idx, grad, accumulate=True)``) and ``topk``'s
# (``value_selecting_reduction_backward``: ``zeros.scatter(dim, indices, grad)``).
_INTO_OWN_ZEROS = {
    "IndexBackward0": (_aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default),
    "TopkBackward0": (_aten.scatter.src,),
}


def _zeros_made_partial(node, func, args, kwargs) -> bool:
    """Whether a backward op DTensor would not run locally is an autograd formula putting a Partial
    gradient into the zeros it makes itself (``_INTO_OWN_ZEROS``: the token gather of
    tensor-parallel MoE experts and the router's top-k, whose gradients are partial sums over TP).
    DTensor's rule takes those zeros Replicate -> Partial(sum): each rank's share is zeros / n,
    which is zeros bit for bit, so the op on the local tensors is the DTensor op's local part. Only
    that move of the first argument qualifies; boolean-mask indices take the handler's own path."""
    if func not in _INTO_OWN_ZEROS.get(node.name(), ()):
        return False
    if func is not _aten.scatter.src:
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        if accumulate is not True or any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            return False
    try:
        moves = data_moves(func, args, kwargs)
    except Exception:
        return False
    return bool(moves) and all(
        i == 0 and all(p == q or src.mesh.size(d) == 1 or (p.is_replicate() and q.is_partial() and q.reduce_op == "sum")
                       for d, (p, q) in enumerate(zip(src.placements, dst.placements)))
        for i, src, dst in moves
    )


def _sized_ops() -> set:
    """Ops whose size (or bound) arguments DTensor rewrites from global to local sizes: those it
    rewrites shapes of, and those with a scalar adjuster (a slice of an interleaved dim's sections:
    ``vescale.dispatch.fast.interleaved``)."""
    prop = DTensor._op_dispatcher.sharding_propagator
    return set(prop.op_to_shape_and_stride_idx) | set(prop.op_to_scalar_shape_adjuster) | {torch.ops.aten.reshape.default}


def _local_shape(out):
    if isinstance(out, DTensor):
        return tuple(out._local_tensor.shape)
    return tuple(out.shape) if isinstance(out, torch.Tensor) else None


class _OpWatcher(TorchDispatchMode):
    """Watches the ops of a module's own body (``stack[-1]`` names it; None while hooks run).

    Recording: notes the first DTensor op that could not run on local shards, and the local output
    shape of every op that takes sizes. Checking (the first static step of a record): the same
    ops, run on local tensors, must give the same shapes; a model that passes a global size (a
    head count from its config, say) where DTensor would have passed a local one fails here, with
    the module and op named, instead of computing something else."""

    def __init__(self, record: Record, stack: list, checking: bool, modules: dict | None = None,
                 mixed_sums: dict | None = None):
        super().__init__()
        self.record, self.stack, self.checking = record, stack, checking
        # the runtime's StaticRuntime.mixed_sums: what _mixed_sum finds outlives this recording
        self.mixed_sums = {} if mixed_sums is None else mixed_sums
        self.modules = modules or {}  # path -> module (whose parameters a masked lookup may read)
        self.sized = _sized_ops()
        self.seen: dict[str, int] = {}
        # Which module's body made each autograd node, as spans of autograd's sequence numbers:
        # (first sequence number, module or None for hooks), one per change of the running body.
        # (An op's node is not reachable from __torch_dispatch__, which runs below autograd, but its
        # sequence number is drawn from one per-thread counter in forward order.)
        self.spans: list[tuple[int, str | None]] = []
        # id(node) -> (node, caller path) for the nodes a tensor's gradient leaves a module boundary
        # through (an eager child's mirrored wrap, a child's body-input alias): autograd adds what
        # it hands back to the caller's other gradients of that tensor while the node is current.
        self.boundary_nodes: dict = {}
        self.shares: GradientShares | None = None  # the recording's (shares.py)
        # recording: the bodies a DTensor reached (an input, a parameter, a child's output) or that
        # ran a DTensor op of their own
        self.dtensor_bodies: set = set()
        # While a checkpointed region is recomputed in the recording's backward: its ops are the
        # recorded forward's again, neither judged nor noted twice (recompute.py).
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        module = self.stack[-1] if self.stack else None
        is_dtensor_op = any(issubclass(t, DTensor) for t in types)
        if module is None:
            out = func(*args, **kwargs)
            if is_dtensor_op and not self.checking:  # after it ran, as _judge
                self._check_backward(func, args, kwargs)
            return out
        if not self.checking and resize.data_dependent_op(func, args):
            self.record.data_dependent.setdefault(module, str(func))
        if is_dtensor_op and not self.checking:
            self.dtensor_bodies.add(module)
        judge = False
        if not self.checking and is_dtensor_op and func in DTensor._op_dispatcher._random_ops:
            # Drawn in static steps too, from the specs recorded here (see _RandomReplay).
            specs = [_spec_of(a) for a in args if isinstance(a, torch.Tensor)]
            self.record.random.setdefault(module, []).append(specs)
        elif not self.checking and module not in self.record.unsafe and is_dtensor_op:
            judge = True  # after it ran: its sharding decision is remembered then (decisions_remembered)
        elif self.checking and self.record.lookups and not is_dtensor_op:  # a static body's op
            check_lookup(self.record.lookups, self.record.program, module, func)
        try:
            out = func(*args, **kwargs)
        except RuntimeError as e:
            if not (self.checking and func in self.sized):
                raise
            # A size that fit the global (DTensor) view no longer fits the local shards.
            raise PlanError(
                f"module {module!r}: {func} fails in Static Eager mode ({_first_line(e)}) although it ran "
                f"on DTensors: the module computes a size that sharding changes (a global size from "
                f"its config, or a length read from a tensor laid out differently from the one it "
                f"reshapes); keep it on DTensors with plan.eager({module!r})"
            ) from e
        if judge:
            self._judge(module, func, args, kwargs)
        if func in self.sized:
            self._check_shape(module, func, out, is_dtensor_op)
        return out

    def _judge(self, module: str, func, args, kwargs) -> None:
        """Keep ``module`` eager if this op of its body cannot run on local shards."""
        why = _why_not_local(func, args, kwargs)
        if why and self._masked_lookup(module, func, args, kwargs):
            why = None  # static steps run it masked on local tensors (local_ops.py)
        why = why or averaged.consumes_average(func, args, kwargs)
        if why:
            self.record.unsafe[module] = why

    def body_changed(self) -> None:
        """Called by the runtime whenever the running body changes (``stack[-1]``)."""
        if not self.checking:
            self.spans.append((torch._C._autograd._get_sequence_nr(), self.stack[-1] if self.stack else None))

    def _module_of(self, node) -> str | None:
        """The module whose body made the autograd node ``node`` in the recorded forward."""
        seq = node._sequence_nr()
        i = bisect.bisect_right(self.spans, seq, key=lambda span: span[0]) - 1
        return self.spans[i][1] if i >= 0 else None

    def _masked_lookup(self, module: str, func, args, kwargs) -> bool:
        """Whether the op is a vocabulary-parallel lookup that static steps run masked on local
        tensors (recorded here), so it need not keep ``module`` eager."""
        mod = self.modules.get(module)
        lookup = masked_lookup(func, args, kwargs, mod._parameters) if mod is not None else None
        if lookup is None:
            return False
        tables = self.record.lookups.setdefault(module, {})
        return tables.setdefault(lookup.param, lookup) == lookup  # one table, looked up one way

    def _check_backward(self, func, args, kwargs) -> None:
        node = torch._C._current_autograd_node()
        if node is not None and self._mixed_sum(node, func, args, kwargs):
            return
        if node is not None and self.shares is not None and self.shares.sums(node, func, args):
            return  # autograd adding a body's share to a tensor's other gradients: shares.settle judges it
        module = self._module_of(node) if node is not None else None
        if module is not None and module not in self.record.unsafe:
            if self._returns_average(module):
                # The backward of a value averaged over ranks (a mean over a DP-sharded batch): static
                # code gets its 1/n share where the value leaves the module (vescale.static.averaged),
                # which is what DTensor's redistributions along this chain compute. (A mean nll_loss
                # is no such value: vescale.dispatch.coverage.semantics makes it a sum over the global count.)
                return
            why = _why_not_local(func, args, kwargs)
            if why and not _zeros_made_partial(node, func, args, kwargs):
                self.record.unsafe[module] = f"in backward, {why}"

    def note_boundary(self, node: torch.autograd.graph.Node | None, caller: str | None) -> None:
        if node is not None and caller is not None:
            self.boundary_nodes[id(node)] = (node, caller)

    def _mixed_sum(self, node, func, args, kwargs) -> bool:
        """Whether ``func`` is autograd adding the gradient a child hands back (``node`` is the
        boundary's) to the caller's other gradients of the same tensor, in layouts DTensor must
        reconcile first: an eager child's input gradient comes back reduced (as ``from_local``
        does), a static sibling's stays a Partial share. DTensor sums those right, a static caller
        would add its local tensors as they are; so the caller stays eager. (Sums of gradients the
        caller's own ops made are judged by the module that made them, as every backward op is.)"""
        found = self.boundary_nodes.get(id(node))
        if found is None or found[0] is not node or func not in SUMS:
            return False
        caller = found[1]
        if caller not in self.record.unsafe and why_rule_not_local(func, args, kwargs):
            layouts = " and ".join(str(tuple(a.placements)) for a in args if isinstance(a, DTensor))
            why = f"in backward, gradients of one tensor arrive from its consumers as {layouts}, which its local tensors cannot add"
            self.record.unsafe[caller] = self.mixed_sums[caller] = why
        return True

    def _returns_average(self, module: str) -> bool:
        crossings = self.record.crossings
        i = 0
        while (module, "result", i) in crossings:
            if averaged.averaged_dims(crossings[(module, "result", i)].spec):
                return True
            i += 1
        return False

    def forget_plain_bodies(self) -> None:
        """End of the recording forward: a body no DTensor reached (an experts module under expert
        parallelism, whose hooks hand it local tokens and parameters) gets the same plain tensors
        in static steps, sized as the data has it (the tokens routed to this rank): no size of it is
        DTensor's to rewrite, and none to check."""
        rec = self.record
        for notes in (rec.sizes, rec.shapes):
            for path, found in notes.items():
                if path not in self.dtensor_bodies:
                    notes[path] = [None] * len(found)

    def _check_shape(self, module: str, func, out, is_dtensor_op: bool) -> None:
        shapes = self.record.shapes.setdefault(module, [])
        if not self.checking:
            # Only DTensor rewrites sizes: an op the recording ran on plain tensors (an experts
            # module's body under expert parallelism, whose hooks hand it local tokens) runs on the
            # same tensors in static steps, with sizes that may follow the data (tokens routed here).
            shapes.append(_local_shape(out) if is_dtensor_op else None)
            return
        k = self.seen[module] = self.seen.get(module, 0) + 1
        want = shapes[k - 1] if k <= len(shapes) else None
        if is_dtensor_op:
            # An eager module's op (or a DTensor a static body made on purpose): DTensor computed its
            # local sizes itself, nothing was rewritten to check. (In a derived record a dim no rank
            # splits, such as a slice one shorter than the sequence, follows no factor, rightly.)
            if isinstance(want, resize.ShapeCandidates):
                shapes[k - 1] = _local_shape(out)
            return
        if isinstance(want, resize.ShapeCandidates):  # a derived record: sizes open, settled here
            want.check(module, func, _local_shape(out))
            shapes[k - 1] = _local_shape(out)
        elif want is not None and _local_shape(out) != want:
            raise PlanError(
                f"module {module!r}: {func} gives a local shape {_local_shape(out)} in Static Eager "
                f"mode but {want} on DTensors: the module computes a size that sharding changes (a "
                f"global size from its config, such as a head count, or a length read from a sharded "
                f"tensor); keep it on DTensors with plan.eager({module!r})"
            )


def _spec_of(t) -> DTensorSpec | None:
    return t._spec if isinstance(t, DTensor) else None


def input_keys(mod: nn.Module, args: tuple, kwargs: dict) -> list:
    """The plan key (``<in>[key]``) of each tensor ``runtime._map_io`` visits: the argument's name (its
    position if the signature has no name for it), None for a tensor inside a container."""
    from ..parallel.hooks import _tensors_in
    from ..plan.lower import forward_arg_names

    names = forward_arg_names(mod)[0]
    keys: list = []
    for key, value in [(names[i] if i < len(names) else i, a) for i, a in enumerate(args)] + list(kwargs.items()):
        keys += [key] if isinstance(value, torch.Tensor) else [None] * len(_tensors_in(value))
    return keys


def output_keys(output: Any) -> list:
    """The plan key (``<out>[key]``) of each tensor ``runtime._map_out`` visits (None inside a nested container)."""
    from ..parallel.hooks import _tensors_in

    if isinstance(output, torch.Tensor):
        return [0]
    items = list(enumerate(output)) if isinstance(output, (tuple, list)) else list(output.items()) if isinstance(output, dict) else []
    if not items:
        return [None] * len(_tensors_in(output))
    keys: list = []
    for key, value in items:
        keys += [key] if isinstance(value, torch.Tensor) else [None] * len(_tensors_in(value))
    return keys
