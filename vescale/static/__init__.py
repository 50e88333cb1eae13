"""Static Eager mode: ``parallelize(model, plan, mesh, mode="static")``.

Forward and backward run on plain local tensors; DTensors appear only at the module boundaries
where the plan redistributes or where a module that must stay eager meets a static one. The first
training step for each set of root input shapes runs eagerly and records what those boundaries
need (see ``runtime``); ``export_plan(model)`` prints what was recorded.
"""

from .export import export_plan
from .install import install_static, static_runtime
from .runtime import State, StaticRuntime

__all__ = ["export_plan", "install_static", "static_runtime", "StaticRuntime", "State"]
