"""vescale's one seam to PyTorch's internals.

* The PyTorch release vescale is built on, checked at import: on another release, say so once,
  with the fix, before anything else is imported.
* Every private PyTorch name vescale uses (DTensor's sharding strategies, op schemas, the redistribute
  planner, the RNG tracker, dispatch-mode stacks) is imported here and nowhere else, so that a PyTorch
  upgrade is this file's work (``tests/test_patches.py`` holds the rest of vescale to it).
* ``PATCHES``: every change vescale makes to PyTorch's behaviour (op handlers and strategies in
  DTensor's tables, attributes on its dispatcher and classes, global optimiser hooks, the RNG
  tracker, implicit replication) is made through it, and ``PATCHES.undo`` (``vescale.uninstall()``)
  gives PyTorch back exactly what it had.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

TESTED_TORCH = "2.13"


def version_warning(version: str) -> str | None:
    """What ``import vescale`` says on PyTorch ``version``: None on the tested release."""
    if version.startswith(TESTED_TORCH + "."):
        return None
    return (
        f"vescale is built and tested against PyTorch {TESTED_TORCH}.*, and this is PyTorch {version}: DTensor "
        f"internals that vescale extends may differ. Install torch=={TESTED_TORCH}.* (pip install "
        f"'torch=={TESTED_TORCH}.*'), or run the test suite (bash scripts/test.sh) against this version first."
    )


_said = version_warning(torch.__version__)
if _said:
    warnings.warn(_said, stacklevel=2)


# ---- private PyTorch names vescale uses: the one place that imports them -------------------------------
# An upgrade of PyTorch that moves or renames one of these breaks here, at import, with the name.

import torch.distributed.tensor._random as dtensor_random
from torch._C._distributed_c10d import (
    AllToAllOptions, AllgatherOptions, AllreduceOptions, BarrierOptions, ReduceScatterOptions,
)
from torch._ops import _len_torch_dispatch_stack_pre_dispatch
from torch.distributed._functional_collectives import _are_we_tracing, all_to_all_single_autograd, wait_tensor
from torch.distributed._local_tensor import local_tensor_mode
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import (
    OpInfo, OpSchema, OpSpec, OpStrategy, OutputSharding, RuntimeSchemaInfo, TupleStrategy,
)
from torch.distributed.tensor._ops import _math_ops, _matrix_ops, _tensor_ops
from torch.distributed.tensor._ops._math_ops import _skip_dim, replicate_reduction_dims
from torch.distributed.tensor._ops._tensor_ops import split_strategy
from torch.distributed.tensor._ops._view_ops import (
    InputDim, _ViewShardingPropagator, dim_maps, propagate_shape_and_sharding,
)
from torch.distributed.tensor._ops.single_dim_strategy import (
    _PreparedSingleDimStrategy, _dijkstra_expand_single_dim_strategy_to_mesh,
    _expand_single_dim_strategy_to_mesh,
)
from torch.distributed.tensor._ops.utils import (
    expand_to_full_mesh_op_strategy, generate_redistribute_costs, is_tensor_evenly_shardable,
)
from torch.distributed.tensor._redistribute import (
    _gen_transform_infos, clear_redistribute_planner_cache, redistribute_local_tensor,
)
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset, compute_local_stride
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.tensor.placement_types import _is_shard_like, _StridedShard, _MaskPartial
from torch.overrides import _get_current_function_mode_stack, _pop_mode as _pop_function_mode, _push_mode as _push_function_mode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import (
    TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode_stack, _pop_mode, _push_mode,
    return_and_correct_aliasing,
)
from torch.utils._pytree import tree_leaves, tree_map_only

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "register_fake_backend", "fake_mode_runs_meta_kernel", "TESTED_TORCH", "clear_sharding_prop_cache", "version_warning", "PATCHES",
    "PatchLayer", "root_mesh", "forward_hook_ids", "hooks_beyond", "hooks_off", "hooks_back", "TakenHooks",
    "take_forward_hooks", "run_pre_hooks", "run_post_hooks", "ForwardErrors", "enter_dispatch_mode_beneath",
    "exit_dispatch_mode", "exit_function_mode",
    "AllToAllOptions", "AllgatherOptions", "AllreduceOptions", "BarrierOptions", "DTensorSpec",
    "InputDim", "OpInfo", "OpSchema", "OpSpec", "OpStrategy", "OutputSharding", "ReduceScatterOptions",
    "RuntimeSchemaInfo", "TensorMeta", "TorchDispatchMode", "TupleStrategy", "_PreparedSingleDimStrategy",
    "_ViewShardingPropagator", "_are_we_tracing", "_device_constructors",
    "_dijkstra_expand_single_dim_strategy_to_mesh", "_disable_current_modes",
    "_expand_single_dim_strategy_to_mesh", "_gen_transform_infos", "_get_current_dispatch_mode_stack",
    "_len_torch_dispatch_stack_pre_dispatch", "_math_ops", "_matrix_ops", "_pop_mode", "_push_mode",
    "_skip_dim", "_tensor_ops", "all_to_all_single_autograd", "clear_redistribute_planner_cache",
    "compute_local_shape_and_global_offset", "compute_local_stride", "dim_maps", "dtensor_random",
    "expand_to_full_mesh_op_strategy", "generate_redistribute_costs", "is_tensor_evenly_shardable",
    "local_tensor_mode", "propagate_shape_and_sharding", "redistribute_local_tensor",
    "replicate_reduction_dims", "return_and_correct_aliasing", "split_strategy", "tree_leaves",
    "tree_map_only", "wait_tensor", "_EmptyStateDictLoadPlanner", "_load_state_dict", "_is_shard_like",
    "_StridedShard", "_MaskPartial", "_get_current_function_mode_stack", "_pop_function_mode",
    "_push_function_mode",
]


def clear_sharding_prop_cache() -> None:
    """Empty DTensor's sharding-propagation cache (imported on use: ``torch.distributed.tensor.debug``
    costs ~1 s of import that a training process does not need)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


@functools.cache
def fake_mode_runs_meta_kernel(op: Any) -> bool:
    """Whether ``FakeTensorMode`` (PyTorch 2.13, sizes without symbols) answers ``op`` by running its
    Meta kernel, as a call on meta-device tensors does: not a prim, no FakeTensor-specific rule
    (constructors, device moves, data-dependent outputs, foreach ops), no registered fake kernel,
    and no Python decomposition it would prefer (``FakeTensorMode._dispatch_impl``'s order). Then
    the meta call gives DTensor's propagation its answer without FakeTensor's bookkeeping."""
    from torch._decomp import decomposition_table, meta_table
    from torch._subclasses.fake_impls import has_meta, op_implementations_checks
    from torch._subclasses.fake_tensor import (
        _DISPATCH_HANDLE_DIRECTLY, _DISPATCH_META_HANDLERS, FakeTensorMode, torch_decomp_decompositions,
    )

    if not isinstance(op, torch._ops.OpOverload) or "prims::" in op._schema.name or not has_meta(op):
        return False
    if op in _DISPATCH_META_HANDLERS or op in _DISPATCH_HANDLE_DIRECTLY:
        return False
    if any(check(op) for check, _ in op_implementations_checks):
        return False
    if torch._library.simple_registry.singleton.find(op.name()).fake_impl.kernel is not None:
        return False
    if op not in meta_table and not FakeTensorMode.cpp_meta_supports_symint(FakeTensorMode, op):
        # FakeTensorMode prefers torch._decomp's decomposition, or CompositeImplicitAutograd's, to the kernel
        if (op in decomposition_table and torch_decomp_decompositions(op)) or torch._C._dispatch_has_kernel_for_dispatch_key(
                op.name(), "CompositeImplicitAutograd"):
            return False
    return True


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced or flattened from (itself if it was built whole)."""
    return mesh._get_root_mesh()


# A module's forward hooks live in these nn.Module dicts (keyed by hook id); emptied, nn.Module calls
# forward directly. Static Eager takes the hooks off modules with nothing to do in a step (quiet
# modules), emptying and refilling the dicts in place, so hook handles stay valid.
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def forward_hook_ids(mod: torch.nn.Module) -> frozenset:
    """The ids of ``mod``'s forward pre-hooks and forward hooks."""
    return frozenset(mod._forward_pre_hooks) | frozenset(mod._forward_hooks)


def hooks_beyond(mod: torch.nn.Module, kept: frozenset) -> bool:
    """Whether ``mod`` has a forward (pre-)hook whose id is not in ``kept`` (asked every static step:
    builds nothing)."""
    return any(k not in kept for k in mod._forward_pre_hooks) or any(k not in kept for k in mod._forward_hooks)


def hooks_off(mod: torch.nn.Module, keep: frozenset = frozenset()) -> list:
    """Take every forward (pre-)hook off ``mod`` but those whose ids are in ``keep``; returns what
    was taken, for :func:`hooks_back`."""
    saved = []
    for name in _HOOK_DICTS:
        hooks = getattr(mod, name)
        off = [(k, v) for k, v in hooks.items() if k not in keep]
        for k, _ in off:
            del hooks[k]
        saved.append(off)
    return saved


def hooks_back(mod: torch.nn.Module, saved: list) -> None:
    """Refill the hook dicts, the saved hooks first (any registered meanwhile after them)."""
    for name, items in zip(_HOOK_DICTS, saved):
        hooks = getattr(mod, name)
        added = list(hooks.items())
        hooks.clear()
        hooks.update(items)
        hooks.update(added)


class TakenHooks(NamedTuple):
    """A module's forward hooks taken off it (:func:`take_forward_hooks`), each with how nn.Module
    calls it: ``pre`` holds (hook, with_kwargs), ``post`` (hook, with_kwargs, always_call)."""

    pre: tuple
    post: tuple
    ids: frozenset


def take_forward_hooks(mod: torch.nn.Module) -> TakenHooks:
    """Take every forward (pre-)hook off ``mod``, for a hook of its own that runs them in their place
    (:func:`run_pre_hooks`, :func:`run_post_hooks`)."""
    pre = tuple((h, k in mod._forward_pre_hooks_with_kwargs) for k, h in mod._forward_pre_hooks.items())
    post = tuple((h, k in mod._forward_hooks_with_kwargs, k in mod._forward_hooks_always_called)
                 for k, h in mod._forward_hooks.items())
    ids = forward_hook_ids(mod)
    for name in _HOOK_DICTS:
        getattr(mod, name).clear()
    return TakenHooks(pre, post, ids)


def run_pre_hooks(mod: torch.nn.Module, hooks: tuple, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Run taken forward pre-hooks as ``nn.Module.__call__`` runs them; returns the inputs they leave."""
    for hook, with_kwargs in hooks:
        if with_kwargs:
            result = hook(mod, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"forward pre-hook must return None or a tuple of (new_args, new_kwargs), but got {result}.")
                args, kwargs = result
        else:
            result = hook(mod, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args, kwargs


def run_post_hooks(mod: torch.nn.Module, hooks: tuple, args: tuple, kwargs: dict, output: Any, raised: bool = False) -> Any:
    """Run taken forward hooks as ``nn.Module.__call__`` runs them; returns the output they leave.
    ``raised``: forward raised, so only the ``always_call`` hooks run, their own errors turned into
    warnings; so do the ones after a hook that raises here."""
    for i, (hook, with_kwargs, always) in enumerate(hooks):
        if raised and not always:
            continue
        try:
            result = hook(mod, args, kwargs, output) if with_kwargs else hook(mod, args, output)
        except Exception as e:
            if not raised:
                run_post_hooks(mod, hooks[i + 1:], args, kwargs, output, raised=True)
                raise
            warnings.warn("module forward hook with ``always_call=True`` raised an exception that was silenced "
                          f"as another error was raised in forward: {e}", stacklevel=2)
            continue
        if result is not None:
            output = result
    return output


class ForwardErrors:
    """What a forward call raised, for a module's always-called forward hook (nn.Module calls it from
    its ``except`` block when forward raised). ``sys.exc_info()`` alone cannot tell: it is also set
    when the module is called inside an ``except`` block of the caller's (a retry loop), so the
    pre-hook notes what was being handled when the call began (``begin``) and the forward hook
    compares (``error``). A stack, for a module called inside its own forward."""

    def __init__(self) -> None:
        self._began_in: list = []

    def begin(self) -> None:
        self._began_in.append(sys.exc_info()[1])

    def error(self) -> BaseException | None:
        began_in = self._began_in.pop() if self._began_in else None
        handled = sys.exc_info()[1]
        return handled if handled is not began_in else None


# Static Eager enters its recording mode beneath the user's dispatch modes (so it sees the ops after
# theirs) and leaves its modes wherever they sit on the stacks, the modes above them left in place.

def _pop_down_to(mode: object, stack: Callable[[], list], pop: Callable[[], object]) -> list:
    """Pop modes off a mode stack down to ``mode`` (popped too), or all of them for None; returns
    the ones above it, top first."""
    above = []
    while stack():
        top = pop()
        if top is mode:
            break
        above.append(top)
    return above


def enter_dispatch_mode_beneath(mode: TorchDispatchMode) -> None:
    """Enter ``mode`` beneath the dispatch modes already open (it sees ops after them)."""
    above = _pop_down_to(None, _get_current_dispatch_mode_stack, _pop_mode)
    mode.__enter__()
    for m in reversed(above):
        _push_mode(m)


def exit_dispatch_mode(mode: TorchDispatchMode) -> None:
    """Exit ``mode`` wherever it is on the dispatch mode stack, leaving the modes above it in place."""
    if not any(m is mode for m in _get_current_dispatch_mode_stack()):
        return
    above = _pop_down_to(mode, _get_current_dispatch_mode_stack, _pop_mode)
    _push_mode(mode)
    mode.__exit__(None, None, None)  # pops it (now the top) and restores its flags
    for m in reversed(above):
        _push_mode(m)


def exit_function_mode(mode: object) -> None:
    """Take ``mode`` off the torch function mode stack wherever it is, leaving the modes above it in
    place (``__exit__`` pops the top one, which may be another module's mode entered later)."""
    if not any(m is mode for m in _get_current_function_mode_stack()):
        return
    for m in reversed(_pop_down_to(mode, _get_current_function_mode_stack, _pop_function_mode)):
        _push_function_mode(m)


def register_fake_backend() -> None:
    """Register PyTorch's ``fake`` process-group backend (collectives return at once), for
    single-process tests and CPU-overhead benchmarks; imported on first use, not with vescale."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registering is its import)


# ---- the patch layer ---------------------------------------------------------------------------------
# Every change vescale makes to PyTorch's behaviour goes through PATCHES, which remembers what was
# there before, so that ``PATCHES.undo(owner)`` gives PyTorch back exactly what it had.

_ABSENT = object()  # "the table had no entry" / "the object had no attribute of its own"


class _Layer:
    """One value vescale put in one place, and the owners (installers) that put it there."""

    __slots__ = ("value", "owners")

    def __init__(self, value: Any, owner: str) -> None:
        self.value = value
        self.owners = [owner]


class _Place:
    """A table entry, an object's attribute or a thread's flag that vescale changed: PyTorch's
    original and vescale's layers over it (a wrapper over a wrapper: fast search, then the
    interleaved rule, on ``mm``)."""

    def __init__(self, where: str, read: Callable[[], Any], write: Callable[[Any], object], original: Any) -> None:
        self.where = where
        self.read = read  # () -> the value in the place now
        self.write = write  # (value or _ABSENT) -> None
        self.original = original
        self.layers: list[_Layer] = []

    def top(self) -> Any:
        return self.layers[-1].value if self.layers else self.original


class PatchLayer:
    """The changes vescale has made to PyTorch, in order, each reversible.

    Installers name themselves as owners ("dispatch.fast.search", "random"); ``undo("dispatch")``
    undoes every owner under that name, newest first, and puts back PyTorch's own entry (or no entry)
    where no other owner still needs vescale's. A place someone else changed after vescale keeps
    their value. Callers hold their own locks; this class is called at install time, not per op."""

    def __init__(self) -> None:
        self._places: dict[tuple, _Place] = {}
        self._removers: dict[str, list] = {}  # owner -> callables that undo a hook or registration
        self._held: collections.Counter = collections.Counter()  # owner -> places it holds: owners() in O(owners)

    # -- making changes --------------------------------------------------------------------------
    def set_item(self, owner: str, table: dict, key: Any, value: Any, where: str = "") -> None:
        """``table[key] = value``."""
        self._put(owner, ("item", id(table), key), value,
                  lambda: _Place(where or f"{_name(table)}[{key}]", lambda: table.get(key, _ABSENT),
                                 lambda v: table.pop(key, None) if v is _ABSENT else table.__setitem__(key, v),
                                 table.get(key, _ABSENT)))

    def delete_item(self, owner: str, table: dict, key: Any, where: str = "") -> None:
        """``del table[key]`` (restored by undo)."""
        self.set_item(owner, table, key, _ABSENT, where)

    def set_attr(self, owner: str, obj: Any, name: str, value: Any) -> None:
        """``obj.name = value``; on an instance this shadows the class's method for that one object."""
        self._put(owner, ("attr", id(obj), name), value,
                  lambda: _Place(f"{_name(obj)}.{name}", lambda: vars(obj).get(name, _ABSENT),
                                 lambda v: delattr(obj, name) if v is _ABSENT else setattr(obj, name, v),
                                 vars(obj).get(name, _ABSENT)))

    def set_flag(self, owner: str, where: str, get: Callable[[], Any], set_: Callable[[Any], object], value: Any) -> None:
        """A thread-local switch (``get() -> value``, ``set_(value)``), recorded for this thread."""
        thread = threading.get_ident()

        def set_here(v: Any) -> None:  # another thread's switch cannot be set from this one: its record is dropped
            if threading.get_ident() == thread:
                set_(v)

        self._put(owner, ("flag", where, thread), value,
                  lambda: _Place(f"{where} (thread {threading.current_thread().name})", get, set_here, get()))

    def on_undo(self, owner: str, remove: Callable[[], object]) -> None:
        """Something undone by a call (a hook's ``handle.remove``, ``atexit.unregister``)."""
        self._removers.setdefault(owner, []).append(remove)

    def _put(self, owner: str, key: tuple, value: Any, make_place: Callable[[], _Place]) -> None:
        place = self._places.get(key)
        if place is None:
            place = self._places[key] = make_place()
        if place.layers and place.layers[-1].value is value:
            if owner not in place.layers[-1].owners:
                place.layers[-1].owners.append(owner)
                self._held[owner] += 1
        else:
            place.layers.append(_Layer(value, owner))
            self._held[owner] += 1
        if place.read() is not value:
            place.write(value)

    @contextlib.contextmanager
    def original(self, kind: str, obj: Any, key: Any) -> Iterator[None]:
        """PyTorch's own value in one place vescale changed (``kind`` "item": ``obj[key]``, "attr":
        ``obj.key``) for the duration of the block, vescale's again after it: how a vescale handler
        lets DTensor's own rule (or PyTorch's RNG tracker) answer a call. A value PyTorch puts there
        meanwhile (a tracker it makes on first use) becomes its original, the one ``undo`` restores.
        Nested blocks over one place leave it to the outermost."""
        place = self._places.get((kind, id(obj), key))
        if place is None or not place.layers or place.read() is not place.top():
            yield
            return
        place.write(place.original)
        try:
            yield
        finally:
            now = place.read()
            if now is not place.original and now is not place.top():
                place.original = now
            place.write(place.top())

    # -- undoing them ----------------------------------------------------------------------------
    def undo(self, owner: str = "") -> None:
        """Undo every change of ``owner`` and of the owners under it ("dispatch" covers
        "dispatch.fast.search"; "" covers all), newest first."""
        mine = lambda o: not owner or o == owner or o.startswith(owner + ".")  # noqa: E731
        for name in [o for o in self._removers if mine(o)][::-1]:
            for remove in self._removers.pop(name)[::-1]:
                remove()
        if not any(mine(o) for o in self._held):
            return
        for key, place in list(self._places.items())[::-1]:
            if not any(mine(o) for layer in place.layers for o in layer.owners):
                continue
            kept = [layer for layer in place.layers if any(not mine(o) for o in layer.owners)]
            if kept and any(layer not in kept for layer in place.layers[:place.layers.index(kept[-1])]):
                # a layer vescale keeps was built over one being undone (a wrapper over a wrapper)
                raise RuntimeError(f"vescale: undo {kept[-1].owners} before {owner!r} at {place.where}")
            for layer in place.layers:
                for o in layer.owners:
                    if mine(o):
                        self._held[o] -= 1
                layer.owners = [o for o in layer.owners if not mine(o)]
            if len(kept) == len(place.layers):
                continue
            before = place.top()
            place.layers = kept
            if place.read() is before:  # nobody changed it after vescale
                place.write(place.top())
            if not place.layers:
                del self._places[key]

    def owners(self, prefix: str = "") -> list[str]:
        """The owners with changes in effect (under ``prefix``)."""
        found = {o for o, n in self._held.items() if n > 0} | set(self._removers)
        return sorted(o for o in found if not prefix or o == prefix or o.startswith(prefix + "."))

    def changes(self) -> list[str]:
        """What vescale has changed in PyTorch now, one line per place: for ``explain`` and docs."""
        return [f"{p.where}: {', '.join(o for layer in p.layers for o in layer.owners)}" for p in self._places.values()] + [
            f"{owner}: {len(removers)} registration(s)" for owner, removers in self._removers.items()]


def _name(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__qualname__


PATCHES = PatchLayer()
