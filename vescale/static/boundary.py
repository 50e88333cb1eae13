"""Precompiled boundary moves of Static Eager mode: local tensor in, local tensor out.

Where a static module meets a static caller and the plan redistributes between them, the general
path wraps the local tensor as a DTensor (``from_local``), lets the plan's hook ``redistribute`` it
and takes the local tensor back (``to_local``): three autograd nodes and DTensor's Python
redistribution planner on every call, forward and backward, although the source and target
layouts are the same step after step. Here each such spot gets, once, a pair of plain-tensor
functions built from the recorded specs: the forward move (recorded placements before the plan's
hook to those after it) and the backward move (the gradient's recorded placements to those
DTensor's own backward would hand back: the source placements with Partial as Replicate, which is
what ``from_local``'s default gradient layout is). One autograd node runs both.

The moves themselves are ``vescale.comm.moves.compile_move``'s: the common one-mesh-dim moves as
a single collective, everything else through DTensor's ``redistribute_local_tensor`` with the same
specs, so every move computes what DTensor would.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor
from vescale._torch import DTensorSpec, TensorMeta, redistribute_local_tensor

from ..comm.grad import accumulate_grad, grad_hook_role
from ..comm.moves import compile_move
from ..dispatch.metas import contiguous_strides, spec_of
from ..parallel.placing import grad_layout

__all__ = [
    "Move", "ParamShadow", "accumulate_grad", "compile_move", "grad_layout", "grad_spec", "local_of", "dtensor_of",
    "settled_on_unit_dims", "HandOvers",
]

class _MoveFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, forward_fn: Callable[[torch.Tensor], torch.Tensor] | None,
        backward_fn: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> torch.Tensor:
        ctx.backward_fn = backward_fn
        return forward_fn(x) if forward_fn is not None else x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, None, None]:
        if grad is None or ctx.backward_fn is None:
            return grad, None, None
        return ctx.backward_fn(grad), None, None


class Move:
    """One boundary spot: the recorded layout before the plan's hook (``src``), after it (``dst``),
    the placements the gradient arrives in at ``dst`` and those it leaves in at ``src`` (None:
    DTensor's default; a plan.redistribute's grad_dst otherwise)."""

    def __init__(self, src: DTensorSpec, dst: DTensorSpec, grad_placements: tuple | None, grad_out_placements: tuple | None = None):
        self.forward_fn = compile_move(src, dst)
        grad_in = spec_of(dst.mesh, tuple(grad_placements or grad_layout(dst.placements)), dst.tensor_meta)
        grad_out = spec_of(src.mesh, tuple(grad_out_placements or grad_layout(src.placements)), src.tensor_meta)
        self.backward_fn = compile_move(grad_in, grad_out)
        self.layouts = (src.placements, dst.placements, grad_in.placements, grad_out.placements)  # for reports

    def __repr__(self) -> str:
        src, dst, g_in, g_out = (list(p) for p in self.layouts)
        return f"Move({src} -> {dst}; grad {g_in} -> {g_out})"

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if not t.requires_grad or not torch.is_grad_enabled():  # no gradient: no autograd node
            return t if self.forward_fn is None else self.forward_fn(t)
        if self.forward_fn is None and self.backward_fn is None:
            return t
        return _MoveFn.apply(t, self.forward_fn, self.backward_fn)


# ---------------------------------------------------------------------------------------------
# DTensor <-> local with specs made once (what from_local / to_local do, without building and
# hashing a new DTensorSpec on every call, forward and backward)
# ---------------------------------------------------------------------------------------------


def grad_spec(spec: DTensorSpec, placements: tuple | None) -> DTensorSpec:
    """The spec of a contiguous gradient of a tensor laid out as ``spec``, in ``placements``
    (None: ``from_local``'s default, the forward placements with Partial as Replicate)."""
    meta = TensorMeta(spec.shape, contiguous_strides(spec.shape), spec.tensor_meta.dtype)
    return spec_of(spec.mesh, tuple(placements or grad_layout(spec.placements)), meta)


def settled_on_unit_dims(placements: tuple | None, spec: DTensorSpec) -> tuple | None:
    """A parameter's gradient placements with the parameter's own on every mesh dim of size 1.

    On a dim of one rank every placement holds the same local tensor (a Partial over one rank is
    its own sum, a Shard the whole dim), so such a gradient is already laid out like its parameter
    there. Handed over as recorded, a gradient ``Partial`` only over a DP of 1 (a ``(1, TP)`` mesh)
    would go into vescale.comm's all-reduce bucket: a packing copy of every such gradient, a
    collective over one rank and the unpacking, for nothing. ``None`` (DTensor's default) stays."""
    if placements is None:
        return None
    mesh, own = spec.mesh, spec.placements
    return tuple(mine if mesh.size(i) == 1 else p for i, (p, mine) in enumerate(zip(placements, own)))


class _LocalOf(torch.autograd.Function):
    """A DTensor's local tensor; its gradient goes back as a DTensor with a fixed spec."""

    @staticmethod
    def forward(ctx: Any, dt: DTensor, spec_of_grad: DTensorSpec) -> torch.Tensor:
        ctx.spec_of_grad = spec_of_grad
        return dt._local_tensor.view_as(dt._local_tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[DTensor | None, None]:
        if grad is None:
            return None, None
        return DTensor(grad.contiguous(), ctx.spec_of_grad, requires_grad=False), None


class _DTensorOf(torch.autograd.Function):
    """A local tensor as the DTensor ``spec`` describes; its gradient comes back in the
    placements of ``spec_of_grad`` (redistributed there if it arrives otherwise)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, spec: DTensorSpec, spec_of_grad: DTensorSpec) -> DTensor:
        ctx.spec_of_grad = spec_of_grad
        return DTensor(t.view_as(t), spec, requires_grad=t.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: DTensor | None) -> tuple[torch.Tensor | None, None, None]:
        if grad is None:
            return None, None, None
        local, want = grad._local_tensor, ctx.spec_of_grad
        if grad._spec.placements != want.placements:
            target = DTensorSpec(want.mesh, want.placements, tensor_meta=grad._spec.tensor_meta)
            local = redistribute_local_tensor(local, grad._spec, target)
        return local, None, None


def local_of(dt: DTensor, spec_of_grad: DTensorSpec) -> torch.Tensor:
    return _LocalOf.apply(dt, spec_of_grad) if dt.requires_grad else dt._local_tensor


def dtensor_of(t: torch.Tensor, spec: DTensorSpec, spec_of_grad: DTensorSpec) -> DTensor:
    return _DTensorOf.apply(t, spec, spec_of_grad)


# ---------------------------------------------------------------------------------------------
# Parameters as plain leaves
# ---------------------------------------------------------------------------------------------


class ParamShadow:
    """A plain leaf tensor standing for a DTensor parameter in a static module's body.

    ``local_of`` costs an autograd node per parameter and module call, and in backward a DTensor
    gradient per call that autograd's AccumulateGrad then detaches and stores through DTensor's
    dispatch. The shadow is a leaf over the parameter's local tensor (same storage and version
    counter, so in-place updates and autograd's saved-tensor checks see the parameter itself);
    autograd accumulates the local gradient on it, summing every use in the step as it would on the
    parameter, and its post-accumulate hook hands the sum over as a DTensor with the recorded
    gradient spec, running the parameter's own hooks as AccumulateGrad does: its tensor hooks (which
    may replace the gradient), the accumulation into ``param.grad``, then its post-accumulate hooks
    (vescale.comm's gradient reduction lives there). Where every hook of the parameter declares
    itself idle for this gradient (its ``GradHookRole.idle_for``, vescale.comm.grad), the hand-over waits in ``hand_overs`` for the end
    of backward.
    """

    def __init__(self, param: DTensor, spec_of_grad: DTensorSpec, hand_overs: "HandOvers | None" = None):
        self.param_ref = weakref.ref(param)
        self.local = param._local_tensor
        self.spec = spec_of_grad
        self.hand_overs = hand_overs
        self.leaf = self.local.detach().requires_grad_()
        self.leaf.register_post_accumulate_grad_hook(self._hand_over)

    def fits(self, param: DTensor) -> bool:
        """Whether the parameter still has the local tensor (and storage) this shadow aliases."""
        local = param._local_tensor
        return local is self.local and local.data_ptr() == self.leaf.data_ptr()

    def _hand_over(self, leaf: torch.Tensor) -> None:
        local, leaf.grad = leaf.grad, None
        param = self.param_ref()
        if param is None or local is None:
            return
        taker = _local_taker(param)
        if taker is not None:
            taker(local.contiguous(), self.spec)
        elif self.hand_overs is not None and _hooks_idle(param, self.spec):
            self.hand_overs.add(param, local, self.spec)
        else:
            accumulate_grad(param, DTensor(local.contiguous(), self.spec, requires_grad=False))


def _local_taker(param: torch.Tensor):
    """Where ``param``'s one hook takes its gradient as a local tensor and spec (``takes_local``: a
    ZeRO-3 gathered copy's, vescale.parallel.zero) and nothing else would see the DTensor gradient
    (no tensor hook, no gradient held), that function; else None."""
    hooks = param._post_accumulate_grad_hooks
    if not hooks or len(hooks) != 1 or param._backward_hooks or param.grad is not None:
        return None
    role = grad_hook_role(next(iter(hooks.values())))
    return role.takes_local if role is not None else None


def _hooks_idle(param: torch.Tensor, spec: DTensorSpec) -> bool:
    """Whether every tensor hook and post-accumulate hook of ``param`` declares that it does nothing
    with a gradient laid out as ``spec`` (vescale.comm's, where the gradient needs no reduction)."""
    for hooks in (param._backward_hooks, param._post_accumulate_grad_hooks):
        for hook in (hooks or {}).values():
            role = grad_hook_role(hook)
            if role is None or role.idle_for is None or not role.idle_for(spec):
                return False
    return True


class HandOvers:
    """Parameter gradients whose hand-over waits for the end of backward, then runs for all at once.

    A hand-over in autograd's order is a Python call from autograd's C++ loop between two kernels,
    which find the interpreter's working set evicted from the CPU caches: on the TP=8 benchmark's
    step the same 39 hand-overs cost ~2.8 ms there and ~1.3 ms as one batch (thread clock, busy
    machine). Order matters only to hooks that act on the gradient (a reduction launched while
    backward still runs), so only parameters whose hooks are all idle for the gradient wait here
    (under TP alone every weight but the SP norms'). They are handed over, through the same
    ``accumulate_grad``, in a callback queued on the autograd engine, before ``backward()``
    returns. A backward that fails midway hands none of them over (``discard`` at the next
    forward)."""

    def __init__(self):
        self.pending: list = []

    def add(self, param: DTensor, local: torch.Tensor, spec: DTensorSpec) -> None:
        if not self.pending:
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
        self.pending.append((param, local, spec))

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        for param, local, spec in pending:
            accumulate_grad(param, DTensor(local.contiguous(), spec, requires_grad=False))

    def discard(self) -> None:
        self.pending = []
