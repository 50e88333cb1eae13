"""Which ops gather a sharded tensor inside the model: is the plan's parallelism really in effect?

Equal losses do not show that a plan splits anything: an op whose sharding rule does not keep a
sharded input sharded gathers it, and the module computes on the whole tensor on every rank, with
the single device's numbers. HF's Phi-3 took q, k and v out of its interleaved ``qkv_proj`` output
with slices that DTensor gathered, so attention ran replicated on every TP rank and only the
projections were split (issue 27). The plan's own moves (``<in>`` / ``<out>`` statements, ZeRO-3
gathers) are what the plan asks for; this looks at the others.

``gathers(model)`` is a context manager: while it is open, every DTensor op the model runs, forward
and backward, is checked for an input that its sharding decision takes from a shard to
``Replicate`` on some mesh dim (``vescale.dispatch.local.data_moves``: DTensor's own decision for
the call), or, for ops run by a handler instead of a sharding rule (SDPA, data-dependent ops), an
input sharded on a mesh dim where no output is. Each is noted with the module whose forward ran it
(in backward: the module whose forward made the autograd node), the op, the argument, its global
shape and placements before and after, and the model's source line that called it::

    with vescale.debug.gathers(model) as report:
        loss = model(**batch).loss
        loss.backward()
    print(report)           # one line per gather, with counts
    report.modules()        # {module path: what it gathers}, like vescale.static.eager_modules

Nothing changes while it watches except speed (a Python dispatch mode sees every op). Ops of Static
Eager mode's static modules run on local tensors and are not seen: they move nothing by
construction (``vescale.static.eager_modules`` names the modules that stay on DTensors). Tests:
``tests/debug/test_gathers.py`` (the Phi-3-like slice named, the zoo LLaMA quiet),
``tests/zoo/test_hf_phi3_parallel.py``.
"""

from __future__ import annotations

import bisect
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from vescale._torch import _is_shard_like, TorchDispatchMode
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

__all__ = ["gathers", "GatherReport", "Gather"]

_TORCH = os.path.dirname(torch.__file__)
_VESCALE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ZOO = os.path.join(_VESCALE, "zoo")  # models live there: their lines are the model's code


@dataclass(frozen=True)
class Gather:
    """One kind of gather: ``module`` (path, ``""`` the root; None outside the model), ``phase``
    (``"forward"`` / ``"backward"``), the op, the argument, its global shape, its placements and what
    the op takes it to, the gathered mesh dim names, and the calling source line (forward)."""

    module: str | None
    phase: str
    op: str
    arg: str
    shape: tuple
    placements: tuple
    to: tuple
    mesh_dims: tuple
    where: str | None

    def __str__(self) -> str:
        module = "outside the model" if self.module is None else repr(self.module or "<root>")
        to = "Replicate" if self.to is None else list(self.to)
        line = (f"{module} ({self.phase}): {self.op} gathers {self.arg} {self.shape} "
                f"{list(self.placements)} -> {to} over {', '.join(self.mesh_dims)}")
        return line + (f" at {self.where}" if self.where else "")


def _mesh_dim_names(mesh, dims) -> tuple:
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    return tuple(names[d] for d in dims)


def _caller() -> str | None:
    """``file:line: code`` of the innermost frame outside torch and vescale's machinery (the model's
    code, ``vescale.zoo``'s models included)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not (path.startswith(_TORCH) or path.startswith("<") or (path.startswith(_VESCALE) and not path.startswith(_ZOO))):
            import linecache

            code = linecache.getline(path, frame.f_lineno).strip()
            return f"{os.path.basename(path)}:{frame.f_lineno}: {code}"
        frame = frame.f_back
    return None


def _dtensors(tree) -> list:
    out = []
    for x in (tree if isinstance(tree, (list, tuple)) else (tree,)):
        if isinstance(x, DTensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out.extend(_dtensors(x))
    return out


class GatherReport(TorchDispatchMode):
    """What ``gathers(model)`` found (see the module doc); a dispatch mode while open."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
        self.counts: dict[Gather, int] = {}
        self._stack: list = []
        self._spans: list[tuple[int, str | None]] = []  # (autograd sequence number, module) at each change
        self._hooks: list = []

    # ---- the modules running ----

    def _mark(self) -> None:
        self._spans.append((torch._C._autograd._get_sequence_nr(), self._stack[-1] if self._stack else None))

    def _pre(self, module, args):
        path = self.paths.get(id(module))
        if path is not None:
            self._stack.append(path)
            self._mark()

    def _post(self, module, args, out):
        if self.paths.get(id(module)) is not None and self._stack:
            self._stack.pop()
            self._mark()

    def _module(self) -> tuple[str | None, str]:
        node = torch._C._current_autograd_node()
        if node is None:
            return (self._stack[-1] if self._stack else None), "forward"
        i = bisect.bisect_right(self._spans, node._sequence_nr(), key=lambda span: span[0]) - 1
        return (self._spans[i][1] if i >= 0 else None), "backward"

    def __enter__(self):
        self._hooks = [register_module_forward_pre_hook(self._pre), register_module_forward_hook(self._post)]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks, self._stack = [], []
        return super().__exit__(*exc)

    # ---- the ops ----

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            try:
                found = self._gathered(func, args, kwargs, out)
            except Exception:  # the op has no decision to ask about (DTensor raised already if it mattered)
                found = []
            if found:
                module, phase = self._module()
                where = _caller() if phase == "forward" else None
                for arg, spec, to, dims in found:
                    key = Gather(module, phase, str(func), arg, tuple(spec.shape), tuple(spec.placements),
                                 to, _mesh_dim_names(spec.mesh, dims), where)
                    self.counts[key] = self.counts.get(key, 0) + 1
        return out

    @staticmethod
    def _gathered(func, args, kwargs, out) -> list:
        """(argument, its spec, what it becomes or None, gathered mesh dims) for the op's inputs."""
        handler = DTensor._op_dispatcher._custom_op_handlers.get(func)
        if handler is None or getattr(handler, "__name__", "") == "sized_op_handler":
            from ..dispatch.local import data_moves

            found = []
            for i, src, dst in data_moves(func, args, kwargs):
                dims = [m for m, (p, q) in enumerate(zip(src.placements, dst.placements))
                        if _is_shard_like(p) and q.is_replicate() and src.mesh.size(m) > 1]
                if dims:
                    found.append((f"arg {i}", src, tuple(dst.placements), dims))
            return found
        # A handler (SDPA, data-dependent ops): an input sharded where no output is sharded or partial.
        outs = _dtensors(out)
        found = []
        for i, a in enumerate(args):
            for d in _dtensors(a):
                dims = [m for m, p in enumerate(d.placements) if _is_shard_like(p) and d.device_mesh.size(m) > 1
                        and not any(_is_shard_like(o.placements[m]) or o.placements[m].is_partial() for o in outs)]
                if dims and outs:
                    found.append((f"arg {i}", d._spec, None, dims))
        return found

    # ---- the report ----

    def modules(self) -> dict[str, str]:
        """{module path: what an op inside it gathered}, the first gather of each module (``"<outside>"``
        for ops outside the model's forward and backward)."""
        out: dict[str, str] = {}
        for g, n in self.counts.items():
            key = "<outside>" if g.module is None else g.module
            if key not in out:
                out[key] = f"{g.phase}: {g.op} gathers {g.arg} {g.shape} {list(g.placements)} over {', '.join(g.mesh_dims)}" + (
                    f" at {g.where}" if g.where else "") + f" ({n} call{'s' if n > 1 else ''})"
        return out

    def __str__(self) -> str:
        if not self.counts:
            return "no op gathered a sharded tensor"
        return "\n".join(f"{g} ({n} call{'s' if n > 1 else ''})" for g, n in self.counts.items())


def gathers(model: nn.Module) -> GatherReport:
    """A context manager that notes, while open, every op that gathers a sharded input inside
    ``model`` (see the module doc); ``with vescale.debug.gathers(model) as report: ...``."""
    return GatherReport(model)
