"""Ranks that stop, skip or drift apart: named errors instead of hangs or silent training.

Every rank must run the same steps (SPMD): collectives pair up by their order on each process group,
so a rank that raises in the middle of a step, or catches an exception and goes on with the next
batch, either leaves the others waiting in a collective (until ``init_mesh(timeout=)``) or, worse,
pairs its next step's collectives with their current one: the ranks then train on, each on another
batch, and print the same loss. This module turns both into errors that name the rank and the step.

**Reports** (``publish`` / ``note_peer_failures``). A rank that fails records one line in the process
group's store (``vescale/fault/<rank>``: the exception and where it happened), once, only on failure;
a rank whose collective then fails adds the others' lines to its error as a note. Where a rank fails
does not matter: an exception leaving the model's forward is seen by the root's always-called hook;
a backward or optimiser step that raised is seen at the next forward (a backward that started
reducing gradients and never finished, an optimiser step that began and never ended); an exception
that ends the process anywhere is recorded at interpreter exit (``atexit``). Collectives vescale
waits on note the reports where they fail: the model's forward, the gradient reduction at the end
of backward, ZeRO-3 re-gathers in backward, the per-tensor reduction, the step check below.

**The step check** (``StepCheck``, ``parallelize(check_steps=True)``). At the start of every forward
call of the root module, before the call's first collective, each rank contributes a few integers
to one all-reduce (MAX of values and their negations: every rank learns each field's largest and
smallest value, and a rank holding each): whether its previous forward call raised, whether it can
go on at all, how many optimiser steps it has taken (of optimisers holding a parallelised model's
parameters), a fingerprint of the call's plain inputs (``InputContract.fingerprint``), and how many
per-rank shares it has drawn from ``vescale.data`` (shares differ by design, so their bits are not
in the fingerprint; their count is the same on every rank in step). The stamps go over a gloo process group of their own, so they pair
up by forward call whatever happened to the training collectives, and every rank raises
``OutOfStepError`` where they differ:

* the ranks were given different inputs, or drew different numbers of per-rank shares: one rank
  skipped or repeated a batch outside the model (found before the call's first collective: nothing
  is trained on mismatched batches). Per-rank shares loaded by other means than ``vescale.data``
  are not covered;
* the ranks have taken different numbers of optimiser steps: the error names the rank that is
  behind and by how many steps (its weights no longer match the others');
* a rank's previous forward call raised where the others' completed (found at the next call: in
  training the others are by then waiting for it in backward, and end within the timeout, naming
  it; a forward-only loop that catches the errors on every rank goes on in step);
* a rank cannot go on: a collective failed on it (its process groups no longer pair operations
  up), or its own backward stopped half way. It still sends its stamp, so the others stop at once.

Since a rank waits for the others' stamps before its forward issues anything, a rank that skipped
part of a step (an exception caught in forward, in the loss, in backward) blocks there instead of
pairing its next forward's collectives with the others' current ones, which gloo may answer by
aborting the process (a size mismatch) or, worse, by computing on.

Nothing is read or written in the store while steps succeed.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import time
import traceback
import weakref
from datetime import timedelta
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..data import shares_drawn
from ..optim import given_params
from .._torch import PATCHES, ForwardErrors

_OWNER = "parallel.faults"

__all__ = ["FaultReporter", "StepCheck", "OutOfStepError", "note_peer_failures", "publish", "stamp_group"]

_KEY = "vescale/fault/{}"
_WAITING_KEY = "vescale/waiting/{}"  # a rank whose step check waits long says where it is
# Where a failed collective's frame names it: torch.distributed's functions, and vescale.comm's
# direct process-group calls (all_gather / reduce_scatter / all_reduce / wait).
_COLLECTIVE_FILES = (
    "torch/distributed/distributed_c10d.py", "torch/distributed/_functional_collectives.py", "vescale/comm/direct.py",
)
_COMM_WORDS = ("gloo", "nccl", "NCCL", "Timed out", "timed out", "Connection reset", "Connection closed", "DistBackendError")
_RANK_BITS = 24  # a rank travels in the low bits of a stamp field (worlds up to 16M ranks)
_VALUE_LIMIT = 1 << (62 - _RANK_BITS)  # values above it are folded (fingerprints) so that no field overflows


class OutOfStepError(RuntimeError):
    """The ranks no longer run the same steps: one raised in a forward the others completed, took a
    different number of optimiser steps, was given another batch, or cannot go on after a failed
    collective. The message names the ranks and the fix."""


def _is_comm_error(e: BaseException) -> bool:
    if isinstance(e, OutOfStepError):
        return False
    return isinstance(e, dist.DistError) or any(w in f"{type(e).__name__}: {e}" for w in _COMM_WORDS)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


@contextlib.contextmanager
def _store():
    """The process group's store (None without one), its calls bounded by a few seconds: used on
    failure paths, where a store whose host has died must cost seconds, not the run's timeout. The
    store's own timeout is restored afterwards (other users, e.g. a new group's rendezvous, need it)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        before = store.timeout
        store.set_timeout(timedelta(seconds=5))
    except Exception:
        yield None
        return
    try:
        yield store
    finally:
        try:
            store.set_timeout(before)
        except Exception:
            pass


def publish(text: str) -> bool:
    """Record this rank's failure (``text``, starting with ``rank <r>:``) for the other ranks, unless
    it recorded one already (its first failure is the one that matters; later ones are consequences).
    False when there is no store to write to."""
    if not dist.is_initialized():
        return False
    with _store() as store:
        if store is None:
            return False
        try:
            store.compare_set(_KEY.format(dist.get_rank()), "", text)  # writes only if absent
            return True
        except Exception:  # the store's host may be the rank that died
            return False


def read_reports(ranks: Iterable[int], wait_s: float = 0.0) -> dict[int, str]:
    """What ``ranks`` published (their failure, else where their step check is waiting), waiting up
    to ``wait_s`` for the first of them to appear."""
    found: dict[int, str] = {}
    with _store() as store:
        if store is None:
            return found
        deadline = time.time() + wait_s
        while True:
            try:
                for r in ranks:
                    for key in (_KEY.format(r), _WAITING_KEY.format(r)):
                        if r not in found and store.check([key]):
                            found[r] = store.get(key).decode()
            except Exception:
                break
            if found or time.time() >= deadline:
                break
            time.sleep(0.1)
    return found


def note_peer_failures(e: BaseException, where: str, wait_s: float = 5.0) -> None:
    """A communication error met in ``where`` (e.g. the gradient reduction at the end of backward):
    record it for the other ranks, add to ``e`` what they reported, and stop this process from
    running further steps (its process groups no longer pair collectives up)."""
    if getattr(e, "_vescale_fault_noted", False) or not dist.is_initialized() or not _is_comm_error(e):
        return
    e._vescale_fault_noted = True
    rank = dist.get_rank()
    PROGRESS.stop(f"a collective failed on rank {rank} in {where} ({type(e).__name__}: {_first_line(e)})")
    if publish(f"rank {rank}: {type(e).__name__}: {_first_line(e)} (in {where})"):
        _add_peer_note(e, rank, where, wait_s)


def _add_peer_note(e: BaseException, rank: int, where: str, wait_s: float) -> None:
    others = read_reports([r for r in range(dist.get_world_size()) if r != rank], wait_s)
    note = "; ".join(others[r] for r in sorted(others)) if others else f"no other rank reported an error within {wait_s:.0f}s"
    e.add_note(
        f"vescale: this rank ({rank}) failed in {where} because another rank did not take part. "
        f"Other ranks: {note}. Every rank must run the same steps: a rank that raises or skips a step "
        "stops the others."
    )


class _Progress:
    """What this process has done that the step check compares, and whether it may go on.

    One per process (optimiser steps and failed collectives concern every model of the process).
    ``install`` registers PyTorch's global optimiser step hooks and an ``atexit`` reporter, once, at
    the first ``parallelize`` (never at import)."""

    def __init__(self):
        self.optimizer_steps = 0
        self.stepping = 0  # optimiser steps begun and not (yet) finished
        self.stopped: str | None = None  # why this process cannot run further steps
        self.last_call = ""  # "forward call 3", for reports of failures outside forward
        self._installed = False

    def install(self) -> None:
        if self._installed:
            return
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        PATCHES.on_undo(_OWNER, register_optimizer_step_pre_hook(self._before_step).remove)
        PATCHES.on_undo(_OWNER, register_optimizer_step_post_hook(self._after_step).remove)
        atexit.register(self._report_uncaught)
        PATCHES.on_undo(_OWNER, lambda: atexit.unregister(self._report_uncaught))
        PATCHES.on_undo(_OWNER, lambda: setattr(self, "_installed", False))
        self._installed = True

    def _before_step(self, optimizer, args, kwargs) -> None:
        self.stepping += 1

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.stepping -= 1
        if _steps_parallel_parameters(optimizer):
            self.optimizer_steps += 1

    def reset(self) -> None:
        """Forget what this process did: for a process forked from one that trained (a test's
        ranks, ``vescale.testing.run_on_ranks``), which starts as a fresh process would."""
        self.optimizer_steps, self.stepping, self.stopped, self.last_call = 0, 0, None, ""

    def stop(self, why: str) -> None:
        if self.stopped is None:
            self.stopped = why

    def phase(self) -> str:
        """Where this process is between forward calls, for a failure seen outside forward."""
        if self.stepping:
            return f"in optimizer.step() after {self.last_call or 'the first forward call'}"
        return f"after {self.last_call}" if self.last_call else "before the first forward call"

    def _report_uncaught(self) -> None:
        """At interpreter exit: an exception that ends the process (anywhere: data loading, the loss,
        backward, the optimiser step) is recorded for the other ranks, whose collectives now fail."""
        e = getattr(sys, "last_value", None)
        if e is None or getattr(e, "_vescale_fault_noted", False) or not dist.is_initialized():
            return
        publish(f"rank {dist.get_rank()}: {type(e).__name__}: {_first_line(e)} (uncaught, {self.phase()}; the process exited)")


PROGRESS = _Progress()
# optimizer -> (parameters it held when last asked, whether one of them is a DTensor)
_HOLDS_DTENSORS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _steps_parallel_parameters(optimizer) -> bool:
    """Whether ``optimizer`` updates a parallelised model's parameters (DTensors). Only those steps
    are compared across ranks: a plain optimiser that one rank steps beside the parallel model (an
    EMA copy, a local probe) changes nothing the ranks must agree on. Cached per optimiser, asked
    again when its parameter count changes (``add_param_group``)."""
    params = given_params(optimizer)  # not the local tensors a local step swaps in around the hooks
    known = _HOLDS_DTENSORS.get(optimizer)
    if known is None or known[0] != len(params):
        known = _HOLDS_DTENSORS[optimizer] = (len(params), any(isinstance(p, DTensor) for p in params))
    return known[1]

# The stamp group: (default process group it was made under, gloo group over every rank).
_STAMP_GROUP: list = []


def stamp_group() -> dist.ProcessGroup | None:
    """The gloo group the step check's stamps travel on, made (collectively: every rank calls it, in
    ``parallelize``) once per process group; None where the check cannot run (no process group, one
    rank, or a backend that does not communicate, such as the fake one of unit tests)."""
    from ..mesh import TEARDOWN, communicates, run_timeout

    if not communicates():
        return None
    default = dist.distributed_c10d._get_default_group()
    if _STAMP_GROUP and _STAMP_GROUP[0][0] is default:
        return _STAMP_GROUP[0][1]
    group = dist.new_group(backend="gloo")

    timeout = run_timeout()
    if timeout is not None:
        # A rank whose forward raised waits here for the others, which may first have to time out
        # in a training collective and read the reports: allow both.
        dist.distributed_c10d._set_pg_timeout(2 * timeout + timedelta(seconds=10), group)
    TEARDOWN.track(group)
    _STAMP_GROUP[:] = [(default, group)]
    return group


def _fold(value: int) -> int:
    return value % _VALUE_LIMIT


class StepCheck:
    """The stamp every rank sends at the start of each forward call of one parallelised model,
    before the call's first collective (see the module docstring).

    A stamp is eight int64 fields, all-reduced with MAX; ``x`` stands for ``(value << 24) | rank``,
    so that the maximum also names a rank holding it, and a field and its negation give the largest
    and the smallest value:

        0 highest rank whose previous forward call raised (-1: none)   1 -(lowest such rank)
        2 highest rank whose previous forward call completed (-1)      3 highest rank that cannot go on (-1)
        4 x of optimiser steps taken   5 -x of them                    6 x of the input fingerprint   7 -x of it
        8 x of per-rank shares drawn from vescale.data (``shares_drawn``)   9 -x of it
    """

    SLOW_S = 2.0  # a stamp wait longer than this is recorded in the store (see ``_wait``)

    def __init__(self, group, fingerprint=None):
        self.group, self.fingerprint = group, fingerprint
        self.last_failed = False
        self.world, self.rank = dist.get_world_size(group), dist.get_rank()
        self.group_failed = False  # a stamp failed: the other ranks are gone, send no more
        self.enabled = True  # benchmarks flip it (on every rank alike, between steps) for an A/B
        self.backend = group._get_backend(torch.device("cpu"))
        from vescale._torch import AllreduceOptions

        self.options = AllreduceOptions()
        self.options.reduceOp = dist.ReduceOp.MAX

    def _send(self, last_failed: bool, stopped: bool, inputs: int):
        r, world = self.rank, self.world
        steps = (PROGRESS.optimizer_steps << _RANK_BITS) | r
        fp = (_fold(inputs) << _RANK_BITS) | r
        shares = (_fold(shares_drawn()) << _RANK_BITS) | r
        stamp = torch.tensor(
            [r if last_failed else -1, -(r if last_failed else world), -1 if last_failed else r,
             r if stopped else -1, steps, -steps, fp, -fp, shares, -shares],
            dtype=torch.int64,
        )
        # On the backend itself: not a c10d dispatcher op, so the step check's stamp is not one of
        # the collectives vescale.debug.CollectiveCounter (or a profiler's op list) counts for a step.
        return self.backend.allreduce([stamp], self.options), stamp

    def before_forward(self, call: int, last_failed: bool, args: tuple, kwargs: dict) -> None:
        """At the start of forward call ``call`` (``last_failed``: this rank's previous call raised):
        send this rank's stamp, wait for every rank's, raise ``OutOfStepError`` where they differ.
        A rank that cannot go on still sends its stamp (so that the others learn why, at once),
        without waiting, and raises."""
        stopped = PROGRESS.stopped
        self.last_failed = last_failed
        if self.enabled and not self.group_failed:
            inputs = self.fingerprint(args, kwargs) if self.fingerprint is not None and stopped is None else 0
            try:
                work, stamp = self._send(last_failed, stopped is not None, inputs)
                if stopped is None:
                    self._wait(work, call)
            except Exception as e:
                self.group_failed = True
                if stopped is None:
                    note_peer_failures(e, f"the step check at the start of forward call {call}")
                    raise
            else:
                if stopped is None:
                    self._judge(stamp.tolist(), call)
        if PROGRESS.stopped is not None:
            raise self._error(
                f"vescale: this rank ({self.rank}) cannot run forward call {call}: {PROGRESS.stopped}. The ranks' "
                "collectives no longer pair up, so the run cannot go on: restart it from the last checkpoint "
                "(vescale.checkpoint.load)", publish_it=False,
            )

    def _wait(self, work, call: int) -> None:
        """Wait for every rank's stamp. A wait of more than ``SLOW_S`` (the others are still in a
        previous step, or stuck there waiting for this rank) is recorded in the store, so that a
        rank whose collective then fails can say where this one is."""
        try:
            work.wait(timedelta(seconds=self.SLOW_S))
            return
        except Exception as e:
            if "timed out" not in str(e).lower():
                raise
        key = _WAITING_KEY.format(self.rank)
        where = (f"rank {self.rank}: waiting at the start of forward call {call} for the other ranks (its forward "
                 f"call {call - 1} {'raised' if self.last_failed else 'completed'})")
        with _store() as store:
            try:
                store.set(key, where)
                said = True
            except Exception:
                said = False
        work.wait()
        if said:
            with _store() as store:
                try:
                    store.delete_key(key)
                except Exception:
                    pass

    def _judge(self, s: list[int], call: int) -> None:
        mask = (1 << _RANK_BITS) - 1
        failed_hi, failed_lo, done_hi, stopped_hi = s[0], -s[1], s[2], s[3]
        steps_hi, steps_lo = s[4], -s[5]
        fp_hi, fp_lo = s[6], -s[7]
        shares_hi, shares_lo = s[8], -s[9]
        if stopped_hi >= 0:  # another rank cannot go on: nor can the run
            PROGRESS.stop(f"rank {stopped_hi} cannot go on{self._reported([stopped_hi])}")
            return
        if failed_hi >= 0 and done_hi >= 0:
            raise self._error(self._failed_message(call, failed_lo, failed_hi, done_hi))
        if steps_hi >> _RANK_BITS != steps_lo >> _RANK_BITS:
            raise self._error(self._steps_message(call, steps_lo >> _RANK_BITS, steps_lo & mask, steps_hi >> _RANK_BITS, steps_hi & mask))
        if shares_hi >> _RANK_BITS != shares_lo >> _RANK_BITS:
            raise self._error(self._shares_message(call, shares_lo >> _RANK_BITS, shares_lo & mask, shares_hi >> _RANK_BITS, shares_hi & mask))
        if fp_hi >> _RANK_BITS != fp_lo >> _RANK_BITS:
            raise self._error(self._inputs_message(call, fp_lo & mask, fp_hi & mask))

    def _error(self, message: str, publish_it: bool = True) -> OutOfStepError:
        e = OutOfStepError(message)
        e._vescale_fault_noted = True
        if publish_it:
            publish(f"rank {self.rank}: OutOfStepError: {message.splitlines()[0][:300]}")
        return e

    def _reported(self, ranks) -> str:
        """What ``ranks`` reported (failure path only), as a parenthesis for a message."""
        found = read_reports([r for r in ranks if r != self.rank][:8], wait_s=5.0)
        shown = [found[r] for r in sorted(found)]
        return f" ({'; '.join(shown)})" if shown else ""

    def _failed_message(self, call: int, lo: int, hi: int, done: int) -> str:
        ranks = f"rank {lo}" if lo == hi else f"ranks {lo}..{hi}"
        return (
            f"vescale: forward call {call - 1} raised on {ranks}{self._reported(sorted({lo, hi}))} but completed on "
            f"rank {done}; the ranks no longer run the same steps. Every rank must run the same steps: a rank "
            "that raises or skips a step stops the others (a loop that catches this error on every rank "
            "goes on in step)."
        )

    def _steps_message(self, call: int, fewest: int, behind: int, most: int, ahead: int) -> str:
        gap = most - fewest
        return (
            f"vescale: the ranks have taken different numbers of optimizer steps at forward call {call}: rank "
            f"{behind} has taken {fewest}, rank {ahead} {most}, so rank {behind} is {gap} step{'s' if gap != 1 else ''} "
            "behind (it skipped optimizer.step(), e.g. after catching an exception from backward() or step()) "
            "and its weights no longer match the other ranks'. Every rank must run the same steps; restart "
            "from the last checkpoint (vescale.checkpoint.load)."
        )

    def _shares_message(self, call: int, fewest: int, behind: int, most: int, ahead: int) -> str:
        return (
            f"vescale: the ranks have drawn different numbers of batches from vescale.data at forward call {call}: "
            f"rank {behind} has drawn {fewest}, rank {ahead} {most}: a rank skipped or repeated a batch (e.g. caught "
            "an exception outside the model and went on with its next batch), so the ranks' shares are from "
            "different global batches. Every rank must run the same steps; restart from the last checkpoint "
            "(vescale.checkpoint.load) with the loader's state (vescale.data.DataLoader.state_dict)."
        )

    def _inputs_message(self, call: int, one: int, other: int) -> str:
        return (
            f"vescale: the ranks were given different inputs at forward call {call} (rank {one} and rank "
            f"{other} differ; this is rank {self.rank}): a rank skipped or repeated a batch (e.g. caught "
            "an exception outside the model and went on with its next batch), or the ranks read different "
            "data. vescale takes a plain tensor passed to the model as the whole global batch, the same on "
            "every rank, and every rank must run the same steps."
        )


class FaultReporter:
    """Root-module hooks: reports of failed forwards (see the module docstring), notes on
    communication errors, and the step check at the start of every forward call when ``check`` is
    given. The pre-hook must run before every other root pre-hook (the data contract's collective)."""

    def __init__(self, root: nn.Module, wait_s: float = 5.0, check: StepCheck | None = None, reducer=None):
        self.paths = {id(m): p or "<root>" for p, m in root.named_modules(remove_duplicate=False)}
        self.calls, self.wait_s, self.check, self.reducer = 0, wait_s, check, reducer
        self.last_failed = False  # the previous forward call raised
        self.errors = ForwardErrors()  # what the forward call running now raised (hook)
        PROGRESS.install()

    def pre_hook(self, mod: nn.Module, args: tuple, kwargs: dict) -> None:
        self.errors.begin()
        self.calls += 1
        PROGRESS.last_call = f"forward call {self.calls}"
        if self.reducer is not None and self.reducer.unfinished():
            self._backward_did_not_finish()
        if self.check is not None:
            self.check.before_forward(self.calls, self.last_failed, args, kwargs)
        elif PROGRESS.stopped is not None:
            raise OutOfStepError(f"vescale: this rank cannot run forward call {self.calls}: {PROGRESS.stopped}")

    def _backward_did_not_finish(self) -> None:
        """This rank's last backward handed gradients to the reducer but never reached its end: an
        exception in backward was caught. The other ranks may be waiting for its gradient reduction,
        and its next collectives would pair with theirs: it cannot go on."""
        self.reducer.abandon()
        rank = dist.get_rank() if dist.is_initialized() else 0
        why = f"its backward after forward call {self.calls - 1} raised (the exception was caught) before the gradient reduction finished"
        PROGRESS.stop(why)
        publish(f"rank {rank}: {why}")

    def hook(self, mod: nn.Module, args: tuple, output: Any) -> None:
        e = self.errors.error()  # not one a caller's except block is handling
        self.last_failed = e is not None
        if e is None or getattr(e, "_vescale_fault_noted", False) or not dist.is_initialized():
            return
        e._vescale_fault_noted = True
        rank = dist.get_rank()
        module, op = self._where(e.__traceback__)
        mine = f"rank {rank}: {type(e).__name__}: {_first_line(e)} (forward call {self.calls}, in {module}" + (
            f", collective {op})" if op else ")")
        comm = _is_comm_error(e)
        if comm:  # this rank's process groups no longer pair operations up with the others'
            PROGRESS.stop(f"a collective failed on rank {rank} in forward call {self.calls}")
        if publish(mine) and comm:
            _add_peer_note(e, rank, f"{op or 'a collective'} in {module} (forward call {self.calls})", self.wait_s)

    def _where(self, tb) -> tuple[str, str | None]:
        module, op = "<root>", None
        for frame, _ in traceback.walk_tb(tb):
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and id(owner) in self.paths:
                module = self.paths[id(owner)]
            if op is None and frame.f_code.co_filename.endswith(_COLLECTIVE_FILES):
                op = frame.f_code.co_name
        return module, op
