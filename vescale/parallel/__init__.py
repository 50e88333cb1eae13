"""Applying a plan: parallelize() and explain()."""

from .api import explain, parallelize
from .faults import OutOfStepError

__all__ = ["parallelize", "explain", "OutOfStepError"]
