"""``record(model, dir, steps=2)``: save what a run computes, as global tensors, to compare runs.

    with vescale.debug.record(model, "run_a/", steps=2):
        for batch in batches:
            model(batch).loss.backward(); opt.step(); opt.zero_grad()

A *step* starts with a forward of the root module and includes the backward that follows. For each
of the first ``steps`` steps the recorder saves, in execution order:

* ``param:NAME`` every parameter's value as the step starts;
* ``out:PATH#CALL.FIELD`` every tensor in every module's forward output (``PATH`` the module path,
  ``<root>`` for the model itself, ``CALL`` how many times that module ran before in the step,
  ``.FIELD`` / ``[i]`` where the tensor sits in the output), when the module returns;
* ``grad:NAME`` every parameter's gradient, reduced, once backward has ended.

DTensors are saved as the global tensors they stand for (``full_tensor()``: every rank takes part,
so every rank must run the same steps inside the ``with``); plain tensors as they are. Only rank 0
writes: ``step<k>.pt`` (a ``torch.save`` dict of plain CPU tensors, loadable with
``weights_only=True``) per step and ``index.json`` (model fingerprint, steps, entries in order).
"""

from __future__ import annotations

import json
import os
import warnings
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..parallel.hooks import _map_named_tensors, _tensors_in

__all__ = ["record", "Recorder", "FORMAT", "INDEX", "model_fingerprint"]

FORMAT = "vescale.debug.record/1"
INDEX = "index.json"


def model_fingerprint(model: nn.Module) -> dict:
    """What identifies the model of a record: its class and its parameters' names and global shapes."""
    cls = type(model)
    return {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "parameters": {name: list(p.shape) for name, p in model.named_parameters()},
    }


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _global_copy(t: torch.Tensor) -> torch.Tensor:
    """The global value of ``t`` as a plain CPU tensor of its own (a collective for a DTensor)."""
    with torch.no_grad():
        t = t.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()  # of a Replicate DTensor: the local tensor itself, not a copy
        # Always copy: a parameter is updated in place by the optimiser after it is recorded.
        return t.cpu().clone()


def _existing_record(directory: str) -> dict | None:
    try:
        with open(os.path.join(directory, INDEX)) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


class Recorder:
    """The context manager ``record()`` returns; ``entries`` lists what was recorded (on rank 0)."""

    def __init__(self, model: nn.Module, directory: str, steps: int = 2, overwrite: bool = False):
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"record(steps={steps!r}): record at least one step (a positive int)")
        self.model, self.directory, self.steps, self.overwrite = model, str(directory), steps, overwrite
        self.writer = _rank() == 0
        self.step = -1  # the step in progress; -1 before the first root forward
        self.calls: dict[str, int] = defaultdict(int)  # module path -> forward calls so far in this step
        self.tensors: dict[str, torch.Tensor] = {}  # this step's, until written
        self.entries: list[dict] = []
        self.handles: list = []
        self._backward_seen = False  # this step's backward has reached the root's outputs

    @property
    def recording(self) -> bool:
        return 0 <= self.step < self.steps

    # -- the directory ------------------------------------------------------------------------

    def _check_directory(self) -> None:
        """Fail on every rank, before any hook, when rank 0 cannot record into the directory."""
        problem = None
        if self.writer:
            old = _existing_record(self.directory)
            if old is not None and not self.overwrite:
                problem = (
                    f"record: {self.directory} already holds a record (of {old.get('model', {}).get('class')}, "
                    f"{old.get('steps')} step(s)); pass overwrite=True or choose another directory"
                )
            elif os.path.exists(self.directory) and not os.path.isdir(self.directory):
                problem = f"record: {self.directory} is a file; give a directory"
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([int(problem is not None)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() and problem is None:
                problem = f"record: rank 0 cannot record into {self.directory} (see rank 0's error)"
        if problem:
            raise FileExistsError(problem)
        if self.writer:
            os.makedirs(self.directory, exist_ok=True)
            for name in os.listdir(self.directory):  # an overwritten record leaves no stale steps
                if name == INDEX or (name.startswith("step") and name.endswith(".pt")):
                    os.remove(os.path.join(self.directory, name))

    def _write_step(self) -> None:
        if self.writer and self.tensors:
            torch.save(self.tensors, os.path.join(self.directory, f"step{self.step}.pt"))
        self.tensors = {}

    def _write_index(self) -> None:
        if not self.writer:
            return
        index = {
            "format": FORMAT,
            "model": model_fingerprint(self.model),
            "steps": min(self.step + 1, self.steps),
            "world_size": dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1,
            "entries": self.entries,
        }
        with open(os.path.join(self.directory, INDEX), "w") as f:
            json.dump(index, f, indent=0)

    # -- hooks ----------------------------------------------------------------------------

    def _save(self, kind: str, key: str, tensor: torch.Tensor, **where) -> None:
        value = _global_copy(tensor)  # on every rank: gathering a DTensor is a collective
        if self.writer:
            name = f"{kind}:{key}"
            self.tensors[name] = value
            self.entries.append({"step": self.step, "key": name, "kind": kind, **where,
                                 "shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")})

    def _on_root_forward(self, module, args) -> None:
        if self.recording:
            self._write_step()  # the previous step's backward is over
        self.step += 1
        self.calls.clear()
        self._backward_seen = False
        if self.recording:
            for name, p in self.model.named_parameters():
                self._save("param", name, p, name=name)

    def _output_hook(self, path: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not self.recording:
                return
            call = self.calls[path]
            self.calls[path] += 1
            module_name = path or "<root>"
            if not path:  # the root: its outputs are where backward starts
                for t in _tensors_in(output):
                    if t.requires_grad:
                        t.register_hook(self._on_backward)

            def save(field: str, t: torch.Tensor) -> torch.Tensor:
                self._save("out", f"{module_name}#{call}{field}", t, module=module_name, call=call)
                return t

            _map_named_tensors(save, output)

        return hook

    def _on_backward(self, grad):
        """Backward reached the root's outputs: save every gradient once it has ended. Gradients do
        not all pass through autograd's accumulation (vescale.comm's buckets and ZeRO-3 units write
        reduced gradients into ``param.grad`` in their own end-of-backward callback), so the saving
        callback queues itself once more, behind every callback queued during backward."""
        if self.recording and not self._backward_seen:
            self._backward_seen = True
            queue = torch.autograd.Variable._execution_engine.queue_callback
            queue(lambda: queue(self._save_grads))
        return grad

    def _save_grads(self) -> None:
        # Reverse module order: roughly the order backward produces them.
        for name, p in reversed(list(self.model.named_parameters())):
            if p.grad is not None:
                self._save("grad", name, p.grad, name=name)

    def __enter__(self) -> "Recorder":
        self._check_directory()
        self.handles.append(self.model.register_forward_pre_hook(self._on_root_forward, prepend=True))
        # Appended after parallelize's hooks: outputs are recorded in their planned placements.
        for path, module in self.model.named_modules():
            self.handles.append(module.register_forward_hook(self._output_hook(path)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        if self.recording:
            self._write_step()
        self._write_index()
        recorded = min(self.step + 1, self.steps)
        if exc[0] is None and recorded < self.steps:
            warnings.warn(f"record: asked for {self.steps} step(s) but the model ran {recorded}; {self.directory} holds {recorded}", stacklevel=2)


def record(model: nn.Module, directory: str, steps: int = 2, overwrite: bool = False) -> Recorder:
    """Record the first ``steps`` steps of ``model`` (single-device or parallelized) into ``directory``.

    Use as ``with record(model, "run_a/"):`` around the training loop, on every rank. A directory that
    already holds a record is refused unless ``overwrite=True``. Compare two records with
    ``python -m vescale.debug.compare run_a/ run_b/`` (or ``vescale.debug.compare_runs``).
    """
    return Recorder(model, directory, steps, overwrite)
