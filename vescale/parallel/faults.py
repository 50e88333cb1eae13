"""Naming the rank and the operation when a step fails on one rank and the others cannot go on.

When one rank raises in the middle of a step (a bad sample, an out-of-memory), the other ranks wait
in their next collective until it times out (``init_mesh(timeout=)``) or its connection breaks;
gloo's message then says only "Timed out waiting 5000ms for recv operation" or "Connection reset by
peer". The root module's always-called forward hook sees every exception leaving the model's forward,
on every rank, and:

* publishes its own failure in the process group's store (``vescale/fault/<rank>``: the exception,
  the forward call, the innermost module and the collective it was in), once, only on failure;
* on a communication error, reads what the other ranks published (waiting a few seconds for the
  rank that failed first) and adds it to the exception as a note, so every rank's error names the
  rank and the operation where things went wrong.

Nothing is communicated while steps succeed.
"""

from __future__ import annotations

import sys
import time
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.nn as nn

__all__ = ["FaultReporter", "note_peer_failures"]

_KEY = "vescale/fault/{}"
# Where a failed collective's frame names it: torch.distributed's functions, and vescale.comm's
# direct process-group calls (all_gather / reduce_scatter / all_reduce / wait).
_COLLECTIVE_FILES = (
    "torch/distributed/distributed_c10d.py", "torch/distributed/_functional_collectives.py", "vescale/comm/direct.py",
)
_COMM_WORDS = ("gloo", "nccl", "Timed out", "timed out", "Connection reset", "Connection closed", "DistBackendError")


def _is_comm_error(e: BaseException) -> bool:
    return isinstance(e, dist.DistError) or any(w in f"{type(e).__name__}: {e}" for w in _COMM_WORDS)


class FaultReporter:
    """Always-called forward hook of the root module (see the module docstring)."""

    def __init__(self, root: nn.Module, wait_s: float = 5.0):
        self.paths = {id(m): p or "<root>" for p, m in root.named_modules(remove_duplicate=False)}
        self.calls, self.wait_s = 0, wait_s

    def pre_hook(self, mod, args) -> None:
        self.calls += 1

    def hook(self, mod, args, output) -> None:
        e = sys.exc_info()[1]
        if e is None or getattr(e, "_vescale_fault_noted", False) or not dist.is_initialized():
            return
        e._vescale_fault_noted = True
        rank = dist.get_rank()
        module, op = self._where(e.__traceback__)
        mine = f"rank {rank}: {type(e).__name__}: {_first_line(e)} (forward call {self.calls}, in {module}" + (
            f", collective {op})" if op else ")")
        store = _store()
        if store is None:
            return
        try:
            # compare_set with "" writes only if absent: a rank's first failure is the one that matters
            # (a later one, e.g. its own timeout after it skipped a step, is a consequence).
            store.compare_set(_KEY.format(rank), "", mine)
        except Exception:  # the store's host may be the rank that died
            return
        if _is_comm_error(e):
            _add_peer_note(e, store, rank, f"{op or 'a collective'} in {module} (forward call {self.calls})", self.wait_s)

    def _where(self, tb) -> tuple[str, str | None]:
        module, op = "<root>", None
        for frame, _ in traceback.walk_tb(tb):
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and id(owner) in self.paths:
                module = self.paths[id(owner)]
            if op is None and frame.f_code.co_filename.endswith(_COLLECTIVE_FILES):
                op = frame.f_code.co_name
        return module, op

def note_peer_failures(e: BaseException, where: str, wait_s: float = 5.0) -> None:
    """A communication error met outside forward (``where``: e.g. the gradient reduction at the end
    of backward, where a data-parallel rank meets its first collective of a step): record it for the
    other ranks and add to ``e`` what they reported."""
    if getattr(e, "_vescale_fault_noted", False) or not dist.is_initialized() or not _is_comm_error(e):
        return
    e._vescale_fault_noted = True
    store, rank = _store(), dist.get_rank()
    if store is None:
        return
    try:
        store.compare_set(_KEY.format(rank), "", f"rank {rank}: {type(e).__name__}: {_first_line(e)} (in {where})")
    except Exception:
        return
    _add_peer_note(e, store, rank, where, wait_s)


def _add_peer_note(e: BaseException, store, rank: int, where: str, wait_s: float) -> None:
    others = _read_others(store, rank, wait_s)
    note = "; ".join(others) if others else f"no other rank reported an error within {wait_s:.0f}s"
    e.add_note(
        f"vescale: this rank ({rank}) failed in {where} because another rank did not take part. "
        f"Other ranks: {note}. Every rank must run the same steps: a rank that raises or skips a step "
        "stops the others."
    )


def _read_others(store, rank: int, wait_s: float) -> list[str]:
    world = dist.get_world_size()
    keys = [_KEY.format(r) for r in range(world) if r != rank]
    found: dict[str, str] = {}
    deadline = time.time() + wait_s
    while time.time() < deadline:
        try:
            for k in keys:
                if k not in found and store.check([k]):
                    found[k] = store.get(k).decode()
        except Exception:
            break
        if found:
            break
        time.sleep(0.1)
    return [found[k] for k in keys if k in found]


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def _store():
    try:
        store = dist.distributed_c10d._get_default_store()
        # Only ever called on a failure path: bound each store call, so that a store whose host has
        # died costs seconds, not the process group's timeout.
        store.set_timeout(timedelta(seconds=5))
        return store
    except Exception:
        return None
