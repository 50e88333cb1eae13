"""An op without a sharding rule: an error that says where it ran and which plan statement avoids it.

DTensor answers an op it has no rule for with ``Operator aten.x does not have a sharding strategy
registered`` — no module, no placements, no way out. :func:`missing_rule_error` turns that into a
:class:`MissingShardingRule` (still a ``NotImplementedError``, so DTensor's own fallback to an op's
decomposition keeps working) that names:

* the op and every DTensor argument's shape, placements and mesh dimension names;
* the module whose forward ran it (found by walking the Python stack for ``nn.Module`` calls, so
  nothing is tracked while the model runs; in backward no forward is on the stack, which it says);
* the plan statement that avoids it: ``Replicate`` for the sharded parameter or the module's input
  on the mesh dims where they are sharded, or — when every argument is already replicated, so no
  plan can help — a rule registered with PyTorch's ``register_sharding``.
"""

from __future__ import annotations

import re
import sys

import torch.nn as nn
from vescale._torch import DTensorSpec, OpSchema

__all__ = ["MissingShardingRule", "missing_rule_error", "running_module"]


class MissingShardingRule(NotImplementedError):
    """An op met DTensors it has no sharding rule for (see the message for the fix)."""


def running_module() -> tuple[str | None, nn.Module | None]:
    """(path from the root, module) of the innermost module whose forward is on this thread's
    stack, or (None, None). The root is the outermost module being called."""
    calls: list = []
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in ("_call_impl", "_wrapped_call_impl"):
            module = frame.f_locals.get("self")
            if isinstance(module, nn.Module) and (not calls or calls[-1] is not module):
                calls.append(module)
        frame = frame.f_back
    if not calls:
        return None, None
    inner, root = calls[0], calls[-1]
    for path, module in root.named_modules(remove_duplicate=False):
        if module is inner:
            return path, inner
    return None, inner


def _specs(op_schema: OpSchema):
    """(argument label, spec) for every DTensor argument."""
    out = []
    for i, a in enumerate(op_schema.args_schema):
        for j, s in enumerate(a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(s, DTensorSpec):
                out.append((f"arg{i}" + (f"[{j}]" if isinstance(a, (list, tuple)) else ""), s))
    out += [(k, v) for k, v in op_schema.kwargs_schema.items() if isinstance(v, DTensorSpec)]
    return out


def _mesh_dims(spec: DTensorSpec) -> list[str]:
    names = spec.mesh.mesh_dim_names or tuple(str(i) for i in range(spec.mesh.ndim))
    return [names[d] for d, p in enumerate(spec.placements) if not p.is_replicate()]


def _suggestion(specs, path: str | None, module: nn.Module | None) -> str:
    sharded = [(label, s) for label, s in specs if _mesh_dims(s)]
    if not sharded:
        return (
            "every argument is already Replicate, so no plan statement avoids it: register a rule "
            "with torch.distributed.tensor.experimental.register_sharding for this op, or compute "
            "this step outside the parallelized model on plain tensors"
        )
    dims = sorted({d for _, s in sharded for d in _mesh_dims(s)})
    if path is None:
        return (f"replicate the sharded argument(s) {[label for label, _ in sharded]} on {dims} before this op "
                f"(plan.shard(<the producing module's path>.<out>, Replicate(), mesh=...))")
    prefix = re.escape(path) + r"\." if path else ""
    # A sharded parameter of the running module is planned by name; anything else came in as an input.
    params = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
    names = {params[id(t)] for t in _sharded_params(module) if id(t) in params} if module is not None else set()
    targets = [re.escape(n) for n in sorted(names)] + ["<in>"]
    statements = [f'plan.shard(r"{prefix}{t}", Replicate(), mesh="{d}")' for t in targets for d in dims]
    return "avoid it by replicating what this module computes it from: " + "; ".join(statements)


def _sharded_params(module: nn.Module):
    return [p for p in module.parameters(recurse=False)
            if hasattr(p, "placements") and any(not q.is_replicate() for q in p.placements)]


def missing_rule_error(op_schema: OpSchema, cause: Exception) -> MissingShardingRule:
    """The error to raise instead of DTensor's bare "no sharding strategy registered"."""
    path, module = running_module()
    specs = _specs(op_schema)
    args = ", ".join(
        f"{label} {tuple(s.shape)} {list(s.placements)} on mesh {s.mesh.mesh_dim_names or s.mesh.shape}"
        for label, s in specs
    )
    where = f"in the forward of module {path or '<root>'!r}" if module is not None and path is not None else (
        "outside any module's forward (in backward, or in code around the model)"
    )
    return MissingShardingRule(
        f"vescale: {op_schema.op} has no DTensor sharding rule; it ran {where} with DTensor arguments "
        f"{args or '(none)'}. Fix: {_suggestion(specs, path, module)}. (PyTorch: {cause})"
    )


def is_missing_rule(error: Exception) -> bool:
    return isinstance(error, NotImplementedError) and not isinstance(error, MissingShardingRule) and (
        "does not have a sharding strategy registered" in str(error)
    )
