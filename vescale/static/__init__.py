"""Static Eager mode: ``parallelize(model, plan, mesh, mode="static")``.

Forward and backward run on plain local tensors; DTensors appear only at the module boundaries
where the plan redistributes or where a module that must stay eager meets a static one. The first
training step for each set of root input shapes runs eagerly and records what those boundaries
need (see ``runtime``); ``export_plan(model)`` prints what was recorded, ``eager_modules(model)``
which modules run on DTensors and why.
"""

from .export import eager_modules, export_plan
from .install import install_static, static_runtime
from .runtime import State, StaticRuntime

__all__ = ["eager_modules", "export_plan", "install_static", "static_runtime", "StaticRuntime", "State"]
