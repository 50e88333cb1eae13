"""Applying a plan: parallelize() and explain()."""

from .api import explain, parallelize

__all__ = ["parallelize", "explain"]
