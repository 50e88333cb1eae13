"""Debugging and inspection tools: per-rank memory accounting (more to come: distributed
breakpoint, plan/IR dumps, run-vs-run tensor comparison)."""

from .memory import bytes_at_rest

__all__ = ["bytes_at_rest"]
