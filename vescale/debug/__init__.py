"""Debugging and inspection tools: per-rank memory accounting, collective counts (more to come: distributed
breakpoint, plan/IR dumps, run-vs-run tensor comparison)."""

from .comm import CollectiveCounter
from .memory import bytes_at_rest

__all__ = ["bytes_at_rest", "CollectiveCounter"]
