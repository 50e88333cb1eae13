"""Flat-buffer optimiser steps: a param group's local shards stepped as a few flat tensors.

An elementwise optimiser's per-tensor loop costs ~10 small ops per parameter (39 tensors of the
zoo LLaMA: ~400 ops, most of the step on CPU); the same update over one flat tensor is ~10 ops. The
non-fused kernels compute every element alike wherever it sits in a tensor, so stepping a flat
tensor gives the per-tensor step's bits (``tests/dispatch/test_flat_optim.py`` checks SGD, Adam,
AdamW, ... with ``torch.equal``). Fused kernels are not position-independent (their vectorised body
and scalar tail round differently): groups with ``fused=True`` stay per tensor.

``FlatLayout`` covers the parameters of one param group with one dtype and device. What is flat:

* parameters: at the layout's first step (the optimiser's pre-step hook: backward is done, the
  update has not started) each contiguous local shard is copied into its slot of ``param_buf`` and
  moved there with ``set_``, so the tensor objects stay: the DTensor parameter, its
  ``_local_tensor`` and whoever holds them see the new storage. The slot is handed out as a
  storage of its own at offset 0 (a DLPack alias of the slot, which keeps the buffer alive): a
  DTensor takes its local tensor's storage offset, and ``deepcopy``, ``torch.save`` and DCP's
  async staging fail on a DTensor with a nonzero one. State entries are made the same way. vescale's own aliases check the
  storage (Static Eager's plain leaves compare data pointers and are remade; ZeRO-3 gathers from
  ``_local_tensor`` each time). A tensor made from the shard before the move (``p.detach()``,
  ``p.to_local()``) keeps the old storage (docs/architecture.md, known limits).
* per-element state (``exp_avg``, ``momentum_buffer``, ...): one buffer per key for good; each
  parameter's entry is a view of it (a DTensor laid out like the parameter), so ``state_dict``,
  DCP and resharding see per-parameter state as before, and in-place writes land in the buffer.
* gradients: not ours (autograd and vescale.comm make new ones every backward), so each step
  copies them into a flat buffer with one ``cat``; the buffer is dropped after the step (no second
  copy of the shards at rest).

Every step checks the layout before using it: a shard no longer in its slot (``model.to()``, a
``load_state_dict`` that replaced storage, ``param.data = ...``) is stepped on a copy in its slot
and copied back, never moved again by this layout; state entries that are not the objects the
layout installed (``load_state_dict``, DCP, a relayout), or scalar tensors written since (version
counter), are *adopted*: values copied into the buffers, entries made views again; state the
buffers cannot hold (another shape or dtype) sends its parameter to the per-tensor step. A local
shard of another shape, dtype or device makes the caller rebuild the layout.

A step runs over *runs*: maximal sequences of consecutive parameters with a gradient whose scalar
state (Adam's ``step``, NAdam's ``mu_product``, ...) is equal, each run a slice of the buffers. A
parameter without a gradient is not stepped and splits the run; its ``step`` then differs from its
neighbours', so it keeps splitting runs, which stays correct. A run's scalar state is a copy of its
first parameter's, written back into every parameter's own scalar tensors after the step, so each
parameter keeps its own ``step``.
"""

from __future__ import annotations

import itertools
from operator import itemgetter

import torch
from torch.distributed.tensor import DTensor

__all__ = ["FlatLayout", "flat_allowed", "layouts_for"]

_SKIP = object()  # no gradient this step: not stepped
_ALONE = object()  # stepped per tensor (state the buffers cannot hold)
_FRESH = ("<no state yet>",)  # the optimiser initialises the whole run's state
_EW = "<per element>"  # marks a per-element key in a parameter's state signature


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def flat_allowed(group: dict) -> bool:
    """Fused kernels round differently by position; a differentiable step keeps its graph per tensor."""
    return not group.get("fused") and not group.get("differentiable")


def _flattable(local: torch.Tensor) -> bool:
    # 0-dim parameters stay per tensor: their per-element state would look like scalar state.
    return local.layout == torch.strided and local.dtype.is_floating_point and local.ndim > 0 and local.numel() > 0


def layouts_for(params: list) -> tuple[list["FlatLayout"], list]:
    """Flat layouts over ``params`` (one per dtype and device with at least two parameters) and
    the parameters they leave out. Duplicates keep the whole group per tensor (the per-tensor loop
    steps a listed-twice parameter twice; a copy-in / copy-out step would not)."""
    if len({id(p) for p in params}) != len(params):
        return [], list(params)
    buckets: dict = {}
    alone = []
    for p in params:
        local = _local(p)
        if _flattable(local):
            buckets.setdefault((local.dtype, local.device), []).append(p)
        else:
            alone.append(p)
    layouts = []
    for members in buckets.values():
        if len(members) > 1:
            layouts.append(FlatLayout(members))
        else:
            alone.extend(members)
    return layouts, alone


def _scalar_sig(value):
    """What a scalar state entry must equal across a run: a 0-dim tensor's dtype, device and value."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.device, value.item())
    return value


class FlatLayout:
    """One param group's parameters of one dtype and device, stepped as runs of flat slices."""

    def __init__(self, params: list):
        self.params = params
        locals_ = [_local(p) for p in params]
        self.shapes = [t.shape for t in locals_]
        self.dtype, self.device = locals_[0].dtype, locals_[0].device
        self.bounds = list(itertools.accumulate([0] + [t.numel() for t in locals_]))
        self.param_buf = torch.cat([t.detach().reshape(-1) for t in locals_])
        self.itemsize = self.param_buf.element_size()
        self.param_views = self._views(self.param_buf)
        self.grad_buf: torch.Tensor | None = None  # allocated for a step only: no second copy of the shards at rest
        self.state: dict[str, torch.Tensor] = {}  # per-element key -> flat buffer
        self.installed: list[dict | None] = [None] * len(params)  # per parameter: key -> its entry
        self.versions: list[dict] = [{} for _ in params]  # scalar tensors' version when installed
        self.sigs: list = [None] * len(params)  # per parameter: its state signature
        self.runs: list = []  # this step's (first, end, run tensor, state given)
        self.copied: list = []  # this step's stepped (index, local) living outside param_buf
        self.homed: list = []  # and those living in it
        self._home(locals_)

    @torch.no_grad()
    def _home(self, locals_: list) -> None:
        """Move each contiguous local shard into its slot of ``param_buf``, keeping the tensor
        object (``set_``): whoever holds the parameter or its local tensor sees the new storage.
        Called from the optimiser's pre-step hook, between backward and the update; see the module
        docstring for who may still hold the old storage."""
        shared = _overlapping(locals_)
        for i, local in enumerate(locals_):
            # shards overlapping another parameter's (views of one tensor) stay where they are
            if local.is_contiguous() and i not in shared:
                slot = self._alias(self.param_buf, i)
                local.set_(slot.untyped_storage(), 0, local.shape, local.stride())

    def _homed(self, i: int, local: torch.Tensor, buf_ptr: int) -> bool:
        """Whether ``local`` still lives in its slot (nobody moved it since the layout was built)."""
        return (
            local.untyped_storage().data_ptr() == buf_ptr + self.bounds[i] * self.itemsize
            and local.storage_offset() == 0
            and local.is_contiguous()
        )

    @property
    def _buf_ptr(self) -> int:
        return self.param_buf.untyped_storage().data_ptr()

    def _empty(self, dtype) -> torch.Tensor:
        return torch.zeros(self.bounds[-1], dtype=dtype, device=self.device)

    def _views(self, buf: torch.Tensor) -> list:
        return [buf[a:b].view(s) for a, b, s in zip(self.bounds, self.bounds[1:], self.shapes)]

    # ---- before the step ------------------------------------------------------------------------

    @torch.no_grad()  # hooks run outside the step's no_grad; plain parameters require grad
    def begin(self, opt: torch.optim.Optimizer) -> list | None:
        """Copy this step's gradients (and shards no longer in their slots) in and put one run
        tensor per run in ``opt.state``; returns the parameters to step per tensor, or None where a
        local tensor changed shape, dtype or device (the caller rebuilds the layout)."""
        locals_, keys = [], []
        for i, (p, shape) in enumerate(zip(self.params, self.shapes)):
            local = _local(p)
            if local.shape != shape or local.dtype != self.dtype or local.device != self.device:
                return None
            locals_.append(local)
            keys.append(self._key(opt, i, p))
        stepped = [i for i, k in enumerate(keys) if k is not _SKIP and k is not _ALONE]
        ptr = self._buf_ptr
        self.copied, self.homed = [], []
        for i in stepped:
            (self.homed if self._homed(i, locals_[i], ptr) else self.copied).append((i, locals_[i]))
        if self.copied:  # moved by someone since the layout was built: stepped on a copy
            torch._foreach_copy_([self.param_views[i] for i, _ in self.copied], [t for _, t in self.copied])
        self.grad_buf = torch.empty(self.bounds[-1], dtype=self.dtype, device=self.device)
        if len(stepped) == len(self.params):
            # one cat: _foreach_copy_ on CPU is a loop of copies, ~4 us apiece
            torch.cat([_local(p.grad).reshape(-1) for p in self.params], out=self.grad_buf)
        elif stepped:
            torch._foreach_copy_([self._grad_view(i) for i in stepped], [_local(self.params[i].grad) for i in stepped])
        self.runs = [self._run_tensor(opt, i, j, keys[i]) for i, j in _runs(keys)]
        return [p for p, k in zip(self.params, keys) if k is _ALONE]

    def _grad_view(self, i: int) -> torch.Tensor:
        return self.grad_buf[self.bounds[i]:self.bounds[i + 1]].view(self.shapes[i])

    def run_tensors(self) -> list:
        """This step's run tensors: what the optimiser steps in place of the layout's parameters."""
        return [run for _, _, run, _ in self.runs]

    def _key(self, opt, i: int, p):
        """_SKIP, _ALONE, _FRESH or the parameter's state signature (equal ones share a run)."""
        g = p.grad
        if g is None:
            return _SKIP
        local = _local(g)
        if local.layout != torch.strided or local.dtype != self.dtype or local.shape != self.shapes[i]:
            return _ALONE
        state = opt.state.get(p)
        if not state:
            self.installed[i] = None
            return _FRESH
        if self._intact(i, p, state):
            return self.sigs[i]
        return self._adopt(i, p, state)

    def _intact(self, i: int, p, state: dict) -> bool:
        mine = self.installed[i]
        if mine is None or len(mine) != len(state):
            return False
        versions = self.versions[i]
        for key, obj in mine.items():
            if state.get(key) is not obj:
                return False
            if key in versions and obj._version != versions[key]:
                return False  # a scalar tensor written since (DCP loads in place)
            if isinstance(obj, DTensor) and obj._spec is not p._spec:
                return False
        return True

    def _adopt(self, i: int, p, state: dict):
        """Take state the layout did not install: per-element values copied into the buffers, the
        entries replaced by views; scalars kept as they are. _ALONE where that cannot be done."""
        self.installed[i], self.versions[i] = None, {}
        mine, versions, sig = {}, {}, []
        for key, value in list(state.items()):
            local = _local(value) if isinstance(value, torch.Tensor) else value
            if isinstance(local, torch.Tensor) and local.ndim > 0:
                if isinstance(value, DTensor) and value._spec != p._spec:
                    return _ALONE
                buf = self._buffer(key, local.dtype)
                if buf is None or local.shape != self.shapes[i]:
                    return _ALONE
                self._view_of(buf, i).copy_(local)
                mine[key] = state[key] = self._entry(buf, i, p)
                sig.append((key, _EW))
            elif isinstance(value, DTensor):
                return _ALONE  # a 0-dim DTensor: not state the per-tensor step made
            else:
                mine[key] = value
                if isinstance(value, torch.Tensor):
                    versions[key] = value._version
                sig.append((key, _scalar_sig(value)))
        self.installed[i], self.versions[i] = mine, versions
        self.sigs[i] = tuple(sorted(sig, key=itemgetter(0)))
        return self.sigs[i]

    def _buffer(self, key: str, dtype) -> torch.Tensor | None:
        buf = self.state.get(key)
        if buf is None:
            buf = self.state[key] = self._empty(dtype)
        return buf if buf.dtype == dtype else None

    def _view_of(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        return buf[self.bounds[i]:self.bounds[i + 1]].view(self.shapes[i])

    def _alias(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s slot of ``buf`` as a tensor of its own storage at offset 0 (DLPack
        makes one over the slot's memory and keeps ``buf`` alive). A DTensor's wrapper takes its
        local tensor's storage offset, and ``copy.deepcopy``, ``torch.save`` and DCP's async
        staging read a wrapper with a nonzero one and fail: every local tensor and state entry
        the layout hands out therefore starts its storage."""
        return torch.from_dlpack(self._view_of(buf, i))

    def _entry(self, buf: torch.Tensor, i: int, p):
        alias = self._alias(buf, i)
        return DTensor(alias, p._spec, requires_grad=False) if isinstance(p, DTensor) else alias

    def _run_tensor(self, opt, i: int, j: int, key):
        a, b = self.bounds[i], self.bounds[j]
        run = self.param_buf[a:b]
        run.grad = self.grad_buf[a:b]
        given = None
        if key is not _FRESH:
            given = {}
            for name, obj in self.installed[i].items():
                if isinstance(obj, torch.Tensor) and obj.ndim > 0:  # per element (parameters have ndim > 0)
                    given[name] = self.state[name][a:b]
                else:
                    given[name] = obj.clone() if isinstance(obj, torch.Tensor) else obj
            opt.state[run] = dict(given)
        return i, j, run, given

    # ---- after the step -------------------------------------------------------------------------

    @torch.no_grad()
    def finish(self, opt: torch.optim.Optimizer) -> None:
        """Copy the stepped shards back and keep each run's state as the parameters' state."""
        if self.copied:
            torch._foreach_copy_([t for _, t in self.copied], [self.param_views[i] for i, _ in self.copied])
        if self.homed:  # updated through the buffer: tell autograd, as an in-place step on them would
            torch.autograd.graph.increment_version([t for _, t in self.homed])
        for i, j, run, given in self.runs:
            run.grad = None
            state = opt.state.pop(run, None) or {}
            if not self._kept_in_place(i, j, state, given):
                self._keep(opt, i, j, state)
        self.runs, self.copied, self.homed, self.grad_buf = [], [], [], None

    def abandon(self, opt: torch.optim.Optimizer) -> None:
        """A step that raised: drop the runs. Shards in their slots and per-element state keep
        what the step wrote into them, as after a per-tensor step that raised; shards stepped on
        a copy are not written back; scalar state (``step``) is left as it was."""
        for _, _, run, _ in self.runs:
            run.grad = None
            opt.state.pop(run, None)
        self.runs, self.copied, self.homed, self.grad_buf = [], [], [], None

    def _kept_in_place(self, i: int, j: int, state: dict, given: dict | None) -> bool:
        """The common step: the run's per-element state is still the buffer slices it was given
        (updated in place), so only its scalars are written back, one ``_foreach_copy_`` per key
        into the parameters' own scalar tensors. False where the slow path must install entries."""
        if given is None or state.keys() != given.keys():
            return False
        scalars = []
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                if value is not given[key]:
                    return False
            elif isinstance(value, torch.Tensor) and key in self.versions[i]:
                scalars.append((key, value))
            elif value is not given[key] and value != given[key]:
                return False  # a Python scalar that changed: the slow path installs it
        for key, value in scalars:
            targets = [self.installed[k][key] for k in range(i, j)]
            torch._foreach_copy_(targets, [value] * len(targets))
            for k, t in zip(range(i, j), targets):
                self.versions[k][key] = t._version
        sig = tuple((k, _EW) if isinstance(v, torch.Tensor) and v.ndim > 0 else (k, _scalar_sig(v)) for k, v in state.items())
        sig = tuple(sorted(sig, key=itemgetter(0)))
        for k in range(i, j):
            self.sigs[k] = sig
        return True

    def _keep(self, opt, i: int, j: int, state: dict) -> None:
        """The slow path: install the run's state as the parameters' own (views, scalar copies)."""
        if not state:  # a stateless step (SGD without momentum): no entries, as per tensor
            return
        a, b = self.bounds[i], self.bounds[j]
        sig, scalars, per_element = [], {}, []
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                buf = self._buffer(key, value.dtype)
                if buf is None or value.shape != (b - a,):
                    raise RuntimeError(f"vescale's flat optimiser step: state {key!r} is not per element of the run")
                if value.data_ptr() != buf[a:b].data_ptr():
                    buf[a:b].copy_(value)
                per_element.append(key)
                sig.append((key, _EW))
            else:
                scalars[key] = value
                sig.append((key, _scalar_sig(value)))
        sig = tuple(sorted(sig, key=itemgetter(0)))
        for k in range(i, j):
            self._install(opt, k, per_element, scalars)
            self.sigs[k] = sig

    def _install(self, opt, k: int, per_element: list, scalars: dict) -> None:
        p = self.params[k]
        state = opt.state[p]
        mine = self.installed[k] if self.installed[k] is not None else {}
        versions = self.versions[k]
        for key in per_element:
            if key not in mine or state.get(key) is not mine[key]:
                mine[key] = state[key] = self._entry(self.state[key], k, p)
        for key, value in scalars.items():
            if isinstance(value, torch.Tensor):
                obj = mine.get(key)
                if key in versions and state.get(key) is obj and obj.shape == value.shape and obj.dtype == value.dtype:
                    obj.copy_(value)
                else:
                    obj = mine[key] = state[key] = value.clone()
                versions[key] = obj._version
            else:
                mine[key] = state[key] = value
                versions.pop(key, None)
        self.installed[k] = mine


def _overlapping(tensors: list) -> set:
    """Indices of tensors whose memory overlaps another's (same storage, intersecting spans)."""
    spans = sorted(
        (t.untyped_storage().data_ptr(), t.storage_offset() * t.element_size(),
         (t.storage_offset() + t.numel()) * t.element_size(), k)
        for k, t in enumerate(tensors)
    )
    out: set = set()
    for (ptr, _, end, k), (ptr2, start2, _, k2) in zip(spans, spans[1:]):
        if ptr == ptr2 and start2 < end:
            out.update((k, k2))
    return out


def _runs(keys: list):
    """(first, end) of each maximal sequence of stepped parameters with equal keys."""
    i, n = 0, len(keys)
    while i < n:
        key = keys[i]
        if key is _SKIP or key is _ALONE:
            i += 1
            continue
        j = i + 1
        while j < n and keys[j] is not _SKIP and keys[j] is not _ALONE and keys[j] == key:
            j += 1
        yield i, j
        i = j
