"""DTensor op dispatch as vescale extends it: op handlers that give single-device semantics where
PyTorch's default differs (and, later, the fast-dispatch rules and caches of the paper's section 6)."""

from .semantics import install_semantic_handlers

__all__ = ["install_semantic_handlers"]
