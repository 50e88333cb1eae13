"""Torch functions a static body runs its own way, recorded call by call.

Two kinds of call in a module's own body would leave the local shards although the recorded facts
say how to run them on the local tensors: the cross entropy on sharded logits (``local_loss.py``) and
a ``view`` / ``reshape`` / ``split`` given a global size, or a plain tensor's sized from a local
shard (``local_sizes.py``). Both are told apart at the level of
the torch functions the model calls, so one ``TorchFunctionMode`` of each phase handles both:

* ``CallWatch`` (the recording forward, on throughout): notes, per module body (``module()``: the
  running body's path, None while hooks run) and per kind, each call in order, as the kernel or
  rewrite its static steps run, or None for the call as it is.
* ``LocalCalls`` (static steps, on only while the body of a module with something recorded runs):
  the k-th call of a kind runs as the k-th note says; a sized call, as the note of the k-th call
  from its call site (the model's line that made it, ``call_site``). A body's control flow may
  depend on its local sizes: HF's mask code expands the position ids only where the batch size
  differs from theirs, which a DP-split batch of one does not; the recording, on the global batch,
  made that call. Counted per body, every later sized call would take the note of the one before.

A torch function mode is off while its own handler runs, so only the calls the model's code makes
reach it, not those inside the functions it calls: the recording and the static steps count the
same calls (static mode assumes the same op sequence every step, as it does for everything else).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .local_loss import cross_entropy_args, loss_kernel
from .local_sizes import SIZED_CALLS, SizeRewrite, size_call, size_rewrite
from vescale._torch import exit_function_mode

from .random_gate import SwitchedMode

__all__ = ["CallWatch", "LocalCalls", "call_site", "local_call_paths", "drop_plain_sizes"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def call_site() -> tuple | None:
    """Where the model's code made the torch function call being handled: the code object and
    instruction of the first frame that is neither torch's own (``torch.split`` is Python code
    calling ``handle_torch_function``) nor a torch function mode's handler (a mode above this one
    passing the call on). The same line gives the same site in every step."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_name == "__torch_function__" or frame.f_code.co_filename.startswith(_TORCH_DIR)):
        frame = frame.f_back
    return (frame.f_code, frame.f_lasti) if frame is not None else None


def local_call_paths(losses: dict, sizes: dict) -> set:
    """The module paths whose static bodies run some call their own way."""
    return {p for p, kernels in losses.items() if any(kernels)} | {p for p, rewrites in sizes.items() if any(rewrites)}


def drop_plain_sizes(sizes: dict) -> None:
    """Forget the bodies none of whose sized calls is rewritten (every module that reshapes has
    notes, almost all None): static steps then look at the few bodies that have rewrites only."""
    for path in [p for p, rewrites in sizes.items() if not any(rewrites)]:
        del sizes[path]


class CallWatch(TorchFunctionMode):
    """Recording forward: notes each ``F.cross_entropy`` call of the running module's own body
    (``module()``), a ``LocalLoss`` or None (left to the op watcher), into ``losses``, and runs the
    kernels on the DTensors' local shards; notes each sized call (``local_sizes.SIZED_CALLS``), a
    ``SizeRewrite`` or None, into ``sizes`` (both: module path -> list by call).
    ``own_ops_off()`` is a context in which the op watcher does not see the module's ops."""

    def __init__(self, module, losses: dict, sizes: dict, own_ops_off, sites: dict | None = None):
        super().__init__()
        self.module, self.losses, self.sizes, self.own_ops_off = module, losses, sizes, own_ops_off
        self.sites = {} if sites is None else sites  # path -> call site per note of ``sizes``

    def close(self) -> None:
        exit_function_mode(self)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        path = self.module() if func is F.cross_entropy or func in SIZED_CALLS else None
        if path is None:
            return func(*args, **kwargs)
        if func in SIZED_CALLS:
            out = func(*args, **kwargs)
            call = size_call(func, args, kwargs)
            self.sizes.setdefault(path, []).append(size_rewrite(call, out) if call is not None else None)
            self.sites.setdefault(path, []).append(call_site())
            return out
        with self.own_ops_off():  # classifying runs ops (DTensor's offset arithmetic) of the runtime's own
            kernel = loss_kernel(cross_entropy_args(args, kwargs))
        self.losses.setdefault(path, []).append(kernel)
        if kernel is None:
            return func(*args, **kwargs)
        with self.own_ops_off():
            return kernel.on_dtensors(cross_entropy_args(args, kwargs))


class LocalCalls(SwitchedMode):
    """On while the body of a module with recorded kernels or rewrites runs (``turn``): in each step,
    its k-th ``F.cross_entropy`` call runs its k-th recorded kernel and its k-th sized call takes its
    k-th recorded rewrite (None: the call as it is). ``derived``: the record was derived for new input
    sizes (a rewrite that no longer fits then means the step must record); ``scale``: derived from a
    record whose first static step ran (``SizeRewrite.local``)."""

    def __init__(self, losses: dict, sizes: dict, own_ops_off, sites: dict | None = None, derived: bool = False,
                 scale: bool = False):
        super().__init__()
        self.losses, self.sizes, self.own_ops_off = losses, sizes, own_ops_off
        self.sites = sites or {}  # path -> the call site of each note in ``sizes`` (CallWatch)
        self.derived, self.scale = derived, scale
        self.path: str | None = None
        self.calls: dict = {}  # (module path, table or call site) -> its calls so far in this step
        self.by_site: dict = {}  # module path -> {call site: indices of its notes}, made at first use

    def turn(self, path: str | None) -> None:
        """On for the running body ``path`` if it has recorded kernels or rewrites, else off."""
        on = path in self.losses or path in self.sizes
        self.path = path if on else None
        self.switch(on)

    def _next(self, table: dict) -> tuple:
        """The running body's notes in ``table`` and this call's index in them, its note at that index
        (None: none, or the call as it is)."""
        notes = table.get(self.path)
        if notes is None:
            return None, -1
        key = (self.path, id(table))
        k = self.calls[key] = self.calls.get(key, -1) + 1
        return (notes, k) if k < len(notes) else (None, -1)

    def _next_sized(self) -> tuple:
        """The running body's sized-call notes and the index of this call's note: the k-th call from
        this call site takes the k-th note recorded there ((None, -1): none)."""
        notes = self.sizes.get(self.path)
        if notes is None:
            return None, -1
        index = self.by_site.get(self.path)
        if index is None:
            index = self.by_site[self.path] = {}
            for i, site in enumerate(self.sites.get(self.path, ())):
                index.setdefault(site, []).append(i)
        key = (self.path, call_site())
        k = self.calls[key] = self.calls.get(key, -1) + 1
        found = index.get(key[1], ())
        return (notes, found[k]) if k < len(found) and found[k] < len(notes) else (None, -1)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SIZED_CALLS:
            notes, k = self._next_sized()
            if notes is None or notes[k] is None:
                return func(*args, **kwargs)
            call = size_call(func, args, kwargs)
            sizes = call.sizes if call is not None else ()
            if not self.derived and isinstance(notes[k], SizeRewrite):
                notes[k] = notes[k].without_local(sizes)  # sizes read from the local tensor stay as they are
            local = notes[k].local(sizes, self.path, func, self.derived, self.scale)
            if local is None:  # the model read the size from the local tensor: nothing to rewrite, ever
                notes[k] = None
                return func(*args, **kwargs)
            return call.run(local)
        if func is not F.cross_entropy:
            return func(*args, **kwargs)
        notes, k = self._next(self.losses)
        kernel = notes[k] if notes is not None else None
        if kernel is None:
            return func(*args, **kwargs)
        call = cross_entropy_args(args, kwargs)
        with self.own_ops_off():
            return kernel(call["input"], call["target"], call)
