"""Activation checkpointing in Static Eager mode: a region's recomputation runs as its forward ran.

``torch.utils.checkpoint`` (non-reentrant) drops what a region's autograd nodes save and, when
backward first needs one of those tensors, runs the region's function again to save them anew; the
original nodes then compute the gradients from the recomputed tensors. So the recomputation must
save the same tensors, in the same order, as the forward did: in a static step, the same local ops
on the same local tensors. The runtime's per-step state that decides them is gone by then (the
random replay, the local calls and the quiet modules' swapped parameters last one forward), and
the running module body, which decides which recorded facts an op of the region's own code gets,
is not one the region's function can show (it runs inside its caller's body).

``vescale.random.checkpoint_context`` (the ``context_fn`` that already puts vescale's generator
back for the recomputation) tells the runtime where each region starts and when it is recomputed
(``vescale.random.checkpointing.listen_to_regions``). At the region's start the runtime notes a
``RegionState``: the record and state of the step, the stack of running bodies, how many random
ops each module has drawn and how many local calls it has made so far, and (until the region's
forward is done) every module whose hooks run in it. Around the recomputation it puts all of that
back: the same record, a fresh random replay and local-call mode whose counters start where the
region's forward started (so a module's k-th draw gets its k-th recorded spec, also for a module
called in several regions), the quiet modules under the region's modules given their local
parameters, and, while recording, the op watcher paused and the recording's notes left alone (the
recomputation is the recorded forward again, not a new one).

Without ``checkpoint_context`` the runtime cannot tell where a region starts (HF's layers checkpoint
their ``forward``, so a layer's first quiet module, hookless, runs before any hook could notice), so a
recording step that runs a module inside a checkpointed region nobody noted raises a ``PlanError``
naming the fix (``unnoted_region``), as does a recomputation that meets a hooked module first.

Reentrant checkpointing (``use_reentrant=True``) cannot be followed: it runs the region's forward
under ``torch.no_grad()``, so the recording step sees no gradient of the region (no gradient
placement at its boundaries, none of its parameters'), and it backpropagates through a new graph
built in backward. Static Eager mode refuses it by name (``refuse_reentrant``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..plan.ir import PlanError

if TYPE_CHECKING:
    from .record import Record
    from .runtime import State, StaticRuntime

__all__ = ["RegionState", "in_backward", "refuse_outside_region", "unnoted_region"]

_FIX = ("pass use_reentrant=False and context_fn=vescale.random.checkpoint_context to torch.utils.checkpoint "
        "(HF: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False, "
        "'context_fn': vescale.random.checkpoint_context}); selective checkpointing: "
        "context_fn=functools.partial(vescale.random.checkpoint_context, policy=...))")


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a forward now is a recomputation)."""
    return torch._C._current_graph_task_id() != -1


def unnoted_region() -> bool:
    """Whether a non-reentrant checkpointed region's forward runs now (``torch.utils.checkpoint``'s
    saved-tensor hooks are the innermost ones)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and "_checkpoint_hook" in getattr(hooks[0], "__qualname__", "")


def refuse_outside_region(path: str, recomputed: bool = True) -> None:
    """A checkpointed region no ``checkpoint_context`` noted runs ``path``: in its forward
    (``recomputed=False``) or its recomputation (reentrant checkpointing, or another ``context_fn``)."""
    node = torch._C._current_autograd_node() if recomputed else None
    if node is not None and node.name() == "CheckpointFunctionBackward":
        raise PlanError(
            f"module {path!r} is recomputed by reentrant activation checkpointing (use_reentrant=True), which "
            f"Static Eager mode cannot follow: its forward runs without autograd, so the recording sees no "
            f"gradient there. {_FIX}"
        )
    when = "is recomputed in backward" if recomputed else "runs in a checkpointed region"
    raise PlanError(
        f"module {path!r} {when} that vescale.random.checkpoint_context did not note: Static Eager mode "
        f"recomputes a region from the state its forward started in, which that context_fn notes; {_FIX}"
    )


@dataclass
class RegionState:
    """What a checkpointed region's forward started from (see the module docstring)."""

    runtime: StaticRuntime
    state: State | None  # the runtime's state in the region's step
    record: Record | None  # that step's Record
    stack: list  # the running bodies at the region's start
    drawn: dict  # module path -> random ops drawn so far this step (the random replay's counters)
    calls: dict  # the local-call mode's counters
    # (module, [(name, local tensor)]): parameters the running bodies had swapped for local ones
    swaps: list = field(default_factory=list)
    entered: set = field(default_factory=set)  # modules whose hooks ran in the region's forward
    open: bool = True  # its forward is still running
    swapped: list = field(default_factory=list)  # (store, name, value before) for its recomputation

    def forward_done(self) -> None:
        self.open = False
        self.runtime._region_done(self)

    def recompute(self) -> _Recomputing:
        return _Recomputing(self)


class _Recomputing:
    """Entered around a region's recomputation (by ``checkpoint_context``'s recompute context)."""

    def __init__(self, region: RegionState):
        self.region = region

    def __enter__(self):
        self.region.runtime._begin_recompute(self.region)
        return self

    def __exit__(self, *exc) -> None:
        self.region.runtime._end_recompute(self.region)
