"""Deferred init with the values of a *normally built* model: the constructor's draws replayed.

A model's constructor draws random numbers that its ``init_weights()`` later overwrites (HF: every
``nn.Linear`` / ``nn.Embedding`` runs its own ``reset_parameters`` before ``post_init``, and nested
``post_init`` calls initialise parts of the model at different times). Those draws move the
generator, so replaying ``init_weights()`` alone on the shards gives other values than the same
model built normally on one device under ``vescale.random.consistent()``.

What this module does, for a model that can be rebuilt from its config (``type(model)(model.config)``,
every HF ``PreTrainedModel`` and the zoo's LLaMA):

1. **Build a twin on the meta device** (factory functions redirected there; see ``_MetaFactories``)
   under a dispatch mode that lets every random op advance
   vescale's generator exactly as the real op would (``generator.reserve``; meta tensors hold no
   values) and notes, for each tensor the op writes into, the generator offset of its draw. A later
   non-random write (``fill_``, ``zero_``, ``copy_``) to a tensor forgets its draw. So after the
   build each parameter has the offset of the draw that gave it its final value, and the generator
   stands where a normal build would leave it.
2. **Replay the model's init code on the shards** as ``materialize`` does, with every random op that
   writes a parameter drawn *at that parameter's recorded offset*: the values of the normal build.
   Afterwards the generator is put where the normal build left it, so later random ops (dropout)
   draw what they would after a normal build.

A parameter whose replayed draw differs in kind or shape from its build draw, or that the build drew
but the replay does not, is an error naming it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from vescale._torch import _device_constructors, TorchDispatchMode

from ..random import generator
from ..random.ops import SUPPORTED, read_call

__all__ = ["BuildDraws", "record_build", "DrawAtRecordedOffsets", "rebuildable"]


@dataclass(frozen=True)
class Draw:
    """The draw that gave a tensor its final value in the build."""

    kind: str
    shape: tuple
    offset: int


def _storage_key(t: torch.Tensor) -> int:
    """One key per storage: ``.data`` aliases and views of a parameter share it (meta tensors too)."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    return t.untyped_storage()._cdata


def _written(func, args) -> torch.Tensor | None:
    """The tensor an in-place op writes (its first argument, marked written in the schema)."""
    schema = func._schema
    if schema.arguments and schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write:
        return args[0] if isinstance(args[0], torch.Tensor) else None
    return None


class BuildDraws(TorchDispatchMode):
    """Active while the twin is built on the meta device (see the module docstring, step 1)."""

    def __init__(self):
        super().__init__()
        self.final: dict[int, Draw] = {}  # storage key -> its last draw

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = _written(func, args)
        if func in SUPPORTED:
            call = read_call(func, args, kwargs)
            with generator.reserve(call.kind, call.dtype, call.shape, **call.params) as draw:
                out = func(*args, **kwargs)  # on meta: shapes only
            if call.target is not None:
                self.final[_storage_key(call.target)] = Draw(call.kind, tuple(call.shape), draw.offset)
            return out
        if target is not None:
            self.final.pop(_storage_key(target), None)  # overwritten without a draw
        return func(*args, **kwargs)


class _MetaFactories(TorchFunctionMode):
    """Tensors made by factory functions go to the meta device (no memory), except ``torch.tensor``:
    not ``with torch.device("meta")``, because HF skips its weight init when ``torch.tensor([])``
    lands on the meta device, and the twin must draw as a real build does."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("device") is None:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


_FACTORIES = _device_constructors() - {torch.tensor}


def rebuildable(model: nn.Module) -> bool:
    """Whether ``type(model)(model.config)`` builds the same model (HF models, the zoo's LLaMA)."""
    # An HF model means transformers is imported already: do not import it (tens of MiB) to ask.
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        return True
    from ..zoo.llama import LlamaConfig

    return isinstance(getattr(model, "config", None), LlamaConfig)


def record_build(model: nn.Module) -> tuple[dict[str, Draw], int] | None:
    """Build ``type(model)(model.config)`` of fake tensors from the generator's current state;
    returns each parameter's final draw by name and the offset the build leaves the generator at
    (the generator itself is left where it was), or None if the twin's parameters are not the
    model's (it was changed after it was built)."""
    start = generator.get_state()
    recorder = BuildDraws()
    with _MetaFactories(), recorder:
        twin = type(model)(model.config)
    end = int(generator.get_state()[1])
    generator.set_state(start)
    shapes = lambda m: {n: tuple(p.shape) for n, p in m.named_parameters(remove_duplicate=False)}  # noqa: E731
    if shapes(twin) != shapes(model):
        return None  # changed after it was built (a resized embedding, a swapped module): no twin
    draws = {}
    for name, p in twin.named_parameters(remove_duplicate=False):
        draw = recorder.final.get(_storage_key(p))
        if draw is not None:
            draws[name] = draw
    return draws, end


class DrawAtRecordedOffsets(TorchDispatchMode):
    """Active while the init code is replayed on the shards (step 2): a random op writing a
    parameter draws at the offset recorded for that parameter in the build."""

    def __init__(self, model: nn.Module, draws: dict[str, Draw]):
        super().__init__()
        self.model_params = list(model.named_parameters(remove_duplicate=False))
        self.names = {_storage_key(p): n for n, p in self.model_params}
        self.draws = draws
        self.replayed: set[int] = set()  # storage keys of the parameters drawn again

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SUPPORTED:
            call = read_call(func, args, kwargs)
            name = self.names.get(_storage_key(call.target)) if call.target is not None else None
            if name is not None:
                want = self.draws.get(name)
                if want is None or want.kind != call.kind or want.shape != tuple(call.shape):
                    from .deferred import DeferredInitError

                    raise DeferredInitError(
                        f"deferred init: the model's init code draws {call.kind} {tuple(call.shape)} for {name!r}, "
                        f"but building the model drew {want.kind + ' ' + str(want.shape) if want else 'nothing'} last "
                        "for it; its normal-build values cannot be replayed"
                    )
                _set_offset(want.offset)
                self.replayed.add(_storage_key(call.target))
        return func(*args, **kwargs)

    def finish(self, build_end: int) -> None:
        """After the replay: every parameter the build drew was drawn again, and the generator
        stands where the normal build would have left it."""
        from .deferred import DeferredInitError

        missing = [n for n, p in self.model_params if n in self.draws and _storage_key(p) not in self.replayed]
        if missing:
            raise DeferredInitError(
                f"deferred init: building the model draws {missing[:5]} last, but its init code does not draw them; "
                "their normal-build values cannot be replayed"
            )
        _set_offset(build_end)


def _set_offset(offset: int) -> None:
    state = generator.get_state()
    state[1] = offset
    generator.set_state(state)
