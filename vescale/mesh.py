"""init_mesh(): the device mesh of a run, built from torchrun's environment.

Initialises the default process group when needed (gloo on CPU, nccl on CUDA) and returns a
``DeviceMesh`` with named dimensions, so plans can say ``mesh="TP"`` and code can say ``mesh["DP"]``.
A plain ``python script.py`` (no torchrun) gets a one-rank group, so a mesh of shape (1, ...) works
for single-process runs and debugging.

Every group vescale makes gets the run's collective timeout (``apply_run_timeout``), and the run's
gloo groups are quieted when the interpreter exits normally (``GroupTeardown``): a gloo worker thread
still releasing a collective's tensors during interpreter finalisation aborts the process.
"""

from __future__ import annotations

import atexit
import functools
import math
import os
import socket
import sys
import time
import weakref
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ._torch import root_mesh

__all__ = ["init_mesh", "adopt_mesh", "is_vescale_mesh", "DEFAULT_TIMEOUT", "run_timeout", "apply_run_timeout", "communicates", "TEARDOWN"]

# How long a collective may wait for its peers before it fails. PyTorch's gloo default is 30 minutes,
# which turns one crashed or diverged rank into a half-hour hang; 10 minutes (NCCL's default) still
# covers slow first steps (compilation, cold sharding propagation) and checkpoint writes.
DEFAULT_TIMEOUT = timedelta(minutes=10)


def _single_process_env() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")


def init_mesh(
    shape: Sequence[int],
    names: Sequence[str],
    device_type: str | None = None,
    *,
    timeout: float | timedelta | None = None,
) -> DeviceMesh:
    """A DeviceMesh of ``shape`` with dimension ``names`` over all ranks of this run.

    ``device_type`` defaults to "cuda" when CUDA is available, else "cpu". ``timeout`` (seconds or a
    timedelta): how long a collective waits for its peers before it raises instead of hanging;
    ``DEFAULT_TIMEOUT`` (10 minutes) for a process group made here; given for a group that exists
    already, it is applied to that group. Under ``torchrun --max-restarts``, a restarted worker joins
    the new attempt's rendezvous (see ``_init_default_group``).
    """
    shape, names = tuple(int(s) for s in shape), tuple(names)
    if len(shape) != len(names):
        raise ValueError(f"init_mesh: shape {shape} has {len(shape)} dimensions but names {names} has {len(names)}")
    if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"init_mesh: dimension names must be distinct non-empty strings, got {names}")
    if any(s < 1 for s in shape):
        raise ValueError(f"init_mesh: every mesh dimension needs at least one rank, got {shape}")
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            if math.prod(shape) != 1:
                raise RuntimeError(
                    f"init_mesh{shape}: needs {math.prod(shape)} ranks but this process was not started by "
                    f"torchrun; run e.g. `torchrun --standalone --nproc-per-node {math.prod(shape)} script.py`"
                )
            _single_process_env()
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        _init_default_group(backend, _as_timedelta(timeout) or DEFAULT_TIMEOUT)
        TEARDOWN.owns_default_group()
    elif timeout is not None:
        dist.distributed_c10d._set_pg_timeout(_as_timedelta(timeout))
    world = dist.get_world_size()
    if math.prod(shape) != world:
        raise ValueError(
            f"init_mesh: mesh shape {shape} holds {math.prod(shape)} ranks but the run has {world}; "
            f"make the product of the shape equal the number of processes"
        )
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    for group in mesh.get_all_groups():
        apply_run_timeout(group)
        TEARDOWN.track(group)
    return adopt_mesh(mesh)


# ---- which meshes vescale answers for ----------------------------------------------------------------
# vescale's op handlers (random ops, item(), losses over a split batch, coverage for SDPA, convolutions
# and data-dependent ops) apply to DTensors on the meshes vescale was given, and to the meshes sliced
# or flattened from them; a DTensor program on any other mesh gets PyTorch's own answers.

# id(root mesh) -> a weak reference to it: by identity (equal meshes are not the same mesh), and not a
# WeakIdKeyDictionary, whose lookup makes a weak reference (~2 us against ~0.3 us here), since every
# call of a vescale op handler asks.
_ADOPTED: dict[int, weakref.ref] = {}


def adopt_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """Give vescale's op semantics (single-device random numbers, a global ``item()``, global loss
    means) to DTensors on ``mesh`` and on every mesh sliced or flattened from it; returns ``mesh``.
    ``init_mesh``, ``parallelize`` and deferred init adopt their mesh; call this for a mesh built
    with ``init_device_mesh`` that carries DTensors of your own, outside a parallelized model."""
    root = root_mesh(mesh)
    key = id(root)
    if key not in _ADOPTED:  # the reference's callback forgets the id when the mesh is gone
        _ADOPTED[key] = weakref.ref(root, functools.partial(_forget, key))
    return mesh


def _forget(key: int, _ref: weakref.ref) -> None:
    _ADOPTED.pop(key, None)


def is_vescale_mesh(mesh: DeviceMesh) -> bool:
    """Whether vescale answers for DTensors on ``mesh`` (see :func:`adopt_mesh`)."""
    root = root_mesh(mesh)
    ref = _ADOPTED.get(id(root))
    return ref is not None and ref() is root


class GroupTeardown:
    """Quiets vescale's gloo process groups when the interpreter exits normally.

    A gloo worker thread (``pt_gloo_runloop``) releases each collective's work object, and with it
    the collective's tensors, after the collective completes. When that release comes after the
    program has returned and the interpreter is being torn down, freeing a tensor's Python object
    makes the thread take the GIL; CPython ends a thread that does so during finalisation with
    ``pthread_exit``, whose stack unwinding cannot cross the ``noexcept`` entry of the
    ``std::thread``: ``std::terminate``, "terminate called without an active exception", SIGABRT
    after a run that succeeded (torchrun then reports it failed, and restarts it under
    ``--max-restarts``). A core dump shows it: the worker in ``~AsyncAllgatherWork`` ->
    ``TensorImpl::decref_pyobject`` -> ``PyEval_AcquireThread`` -> ``pthread_exit`` ->
    ``std::terminate``, the main thread in ``Py_FinalizeEx``. Plain ``torch.distributed`` shows it
    too (four gloo ranks, ten all-gathers not waited for: 3 aborts in 20 launches); a collective
    that was waited for can still be released late by a worker the OS has not scheduled yet (the
    2-in-25 aborts of the issue, on a loaded machine). ``destroy_process_group()`` does not help:
    the process groups live on while anything refers to them (a DeviceMesh's cached sub-meshes,
    vescale's compiled moves and gather programs, the model), so their threads are only joined
    during finalisation, which is the race.

    So an ``atexit`` handler (it runs after Python has joined the program's threads, so a background
    checkpoint write has finished, and while the interpreter is still whole) waits, through the
    store, until every rank has reached its own exit (no collective: a rank still training would
    pair it with its next one), then takes every gloo group of the run through a barrier (gloo's
    barrier waits for every collective queued before it) and gives the workers a moment to release
    what they ran. Only after a normal exit with vescale's groups in use, and only when every rank
    arrives within ``MEET_S``: after an uncaught exception, or once a collective failed
    (``vescale.parallel.faults``), a group may still wait for a peer that will not come, and the
    process is failing anyway."""

    GRACE_S = 0.05  # for a worker to release the work it just finished, once the barrier has passed
    MEET_S = 30.0  # how long a rank at exit waits for the others to reach theirs

    def __init__(self) -> None:
        self.active = False
        self._registered = False

    def owns_default_group(self) -> None:
        self.track(None)

    def track(self, group: dist.ProcessGroup | None) -> None:
        """vescale made or uses ``group``: quiet the run's groups at exit."""
        self.active = True
        if not self._registered:
            atexit.register(self.at_exit)
            self._registered = True

    def at_exit(self) -> None:
        if not self.active or not (dist.is_available() and dist.is_initialized()):
            return
        if getattr(sys, "last_value", None) is not None:  # an uncaught exception ends the process
            return
        from .parallel.faults import PROGRESS

        if PROGRESS.stopped is not None:
            return
        if not self._every_rank_is_exiting():
            return
        from vescale._torch import BarrierOptions

        options = BarrierOptions()
        options.timeout = min(run_timeout() or DEFAULT_TIMEOUT, timedelta(seconds=60))
        try:
            # Every rank's groups, in the order they were made (the same on every rank).
            for group in list(dist.distributed_c10d._world.pg_map):
                if "gloo" in str(dist.get_backend(group)):
                    group._get_backend(torch.device("cpu")).barrier(options).wait()
        except Exception:  # a peer already gone: nothing more to do; the process is ending
            return
        time.sleep(self.GRACE_S)

    def _every_rank_is_exiting(self) -> bool:
        if not communicates():
            return dist.get_world_size() == 1
        try:
            store = dist.distributed_c10d._get_default_store()
            if store.add("vescale/exit/arrived", 1) == dist.get_world_size():
                store.set("vescale/exit/all", "1")
            store.wait(["vescale/exit/all"], min(run_timeout() or DEFAULT_TIMEOUT, timedelta(seconds=self.MEET_S)))
            return True
        except Exception:  # a rank did not come (it failed, or is still running): leave the groups alone
            return False


TEARDOWN = GroupTeardown()


def communicates() -> bool:
    """Whether the default process group talks to other processes (gloo, nccl, mpi, ...): False
    without one and for PyTorch's ``fake`` backend, whose one process plays a rank of a world whose
    other ranks do not exist (collectives return at once, the store holds only this process's keys)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return False
    return "fake" not in str(dist.get_backend())


def run_timeout() -> timedelta | None:
    """The default process group's collective timeout (what ``init_mesh(timeout=)`` set), or None
    when there is no process group or its backend does not say."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return _timeout_of(dist.distributed_c10d._get_default_group())


def apply_run_timeout(group: dist.ProcessGroup, scale: float = 1.0) -> None:
    """Give ``group`` the run's collective timeout (times ``scale``).

    ``torch.distributed.new_group``, and so every DeviceMesh dimension that is not the whole world,
    flattened sub-meshes and vescale's own groups, starts with the backend's default timeout (30
    minutes on gloo) instead of the one the run was started with: a rank waiting there for a peer
    that stopped would hang for half an hour although ``init_mesh(timeout=30)`` was asked for.
    Every group vescale makes or takes from a mesh goes through here."""
    wanted = run_timeout()
    if wanted is None or group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
        return
    wanted = wanted * scale
    if _timeout_of(group) != wanted:
        dist.distributed_c10d._set_pg_timeout(wanted, group)


def _timeout_of(group: dist.ProcessGroup) -> timedelta | None:
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            return group._get_backend(device).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return None


def _as_timedelta(timeout: float | timedelta | None) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"init_mesh: timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
    return timedelta(seconds=timeout)


def _init_default_group(backend: str, timeout: timedelta) -> None:
    """``init_process_group`` from torchrun's environment, on a store private to this restart attempt.

    torchrun's agent keeps one TCPStore for the whole job. Workers of a restarted attempt that
    rendezvous through it find the keys the dead attempt's workers left (gloo's peer addresses among
    them), connect to processes that no longer exist and hang. Prefixing every key with the attempt
    number (``TORCHELASTIC_RESTART_COUNT``, set by torchrun for each attempt) gives each attempt a
    clean namespace in the same store.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
        is_master=not agent_store and rank == 0, timeout=timeout, multi_tenant=not agent_store,
    )
    store = dist.PrefixStore(f"vescale/attempt_{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
