"""Debugging tools for distributed runs that should compute what one device computes.

* ``breakpoint(rank=0)``: pdb on chosen ranks of a torchrun job (served on a loopback socket), the
  other ranks parked without a process-group timeout; ``pg EXPR`` prints a DTensor's global tensor.
* ``record(model, dir, steps=2)``: saves every module output, parameter and gradient of the first
  steps as global tensors; ``python -m vescale.debug.compare a/ b/`` names the first one where two
  runs part (``compare_runs`` is the same check as a function).
* ``bytes_at_rest``: per-rank memory of training state; ``CollectiveCounter``: collectives by kind.
* ``gathers(model)``: which ops inside the model gather a sharded tensor (a plan whose parallelism
  is not in effect there), by module, op, argument and source line.

See docs/debug.md.
"""

from .comparing import Comparison, RecordMismatch, compare_runs
from .distributed_pdb import breakpoint
from .comm import CollectiveCounter
from .gathers import Gather, GatherReport, gathers
from .memory import bytes_at_rest
from .record import record

__all__ = ["breakpoint", "record", "compare_runs", "Comparison", "RecordMismatch", "bytes_at_rest", "CollectiveCounter",
           "gathers", "GatherReport", "Gather"]
