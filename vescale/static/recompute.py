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

Reentrant checkpointing (``use_reentrant=True``) cannot be followed: it runs the region's forward
under ``torch.no_grad()``, so the recording step sees no gradient of the region (no gradient
placement at its boundaries, none of its parameters'), and it backpropagates through a new graph
built in backward. Static Eager mode refuses it by name (``refuse_reentrant``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..plan.ir import PlanError

__all__ = ["RegionState", "in_backward", "refuse_outside_region"]

_FIX = ("pass use_reentrant=False and context_fn=vescale.random.checkpoint_context to torch.utils.checkpoint "
        "(HF: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False, "
        "'context_fn': vescale.random.checkpoint_context}); selective checkpointing: "
        "context_fn=functools.partial(vescale.random.checkpoint_context, policy=...))")


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a forward now is a recomputation)."""
    return torch._C._current_graph_task_id() != -1


def refuse_outside_region(path: str) -> None:
    """A module's forward runs during backward with no region recomputing: reentrant checkpointing,
    or a ``context_fn`` other than vescale's."""
    node = torch._C._current_autograd_node()
    if node is not None and node.name() == "CheckpointFunctionBackward":
        raise PlanError(
            f"module {path!r} is recomputed by reentrant activation checkpointing (use_reentrant=True), which "
            f"Static Eager mode cannot follow: its forward runs without autograd, so the recording sees no "
            f"gradient there. {_FIX}"
        )
    raise PlanError(
        f"module {path!r} runs its forward during backward (activation checkpointing recomputes it) outside "
        f"a region vescale knows: Static Eager mode recomputes a region from the state its forward started "
        f"in, which vescale.random.checkpoint_context notes; {_FIX}"
    )


@dataclass
class RegionState:
    """What a checkpointed region's forward started from (see the module docstring)."""

    runtime: object  # the StaticRuntime
    state: object  # its State in the region's step
    record: object  # that step's Record
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

    def recompute(self):
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
