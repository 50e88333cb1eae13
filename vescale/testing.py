"""Run a function on N real ranks (one process each, gloo backend) and collect what each returns.

Tests and benchmarks use this to check behaviour that needs real collectives: the parent forks
``world_size`` children, each initialises a gloo process group on a private localhost port, calls
``fn(*args)`` and sends back its return value (or its traceback). A rank that hangs is killed after
``timeout`` seconds and the call fails instead of blocking the suite. As under torchrun (whose agent
hosts the store), the process group's store lives in a process of its own that outlives every rank:
a rank that finishes first does not take the store down with it while the others still report
through it (``vescale.parallel.faults``). ``run_script`` runs an example script in such a rank as
torchrun would.

Split checks (equal losses cannot show that a plan split anything): ``assert_local_shapes``
(each parameter's local shard against the test's own statement of the split) and
``input_shapes`` (what a module's body receives: a DP rank's share of the batch).
"""

from __future__ import annotations

import gc
import io
import math
import multiprocessing as mp
import os
import pickle
import re
import runpy
import sys
import traceback
from contextlib import contextmanager, redirect_stdout
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from vescale._torch import register_fake_backend

__all__ = [
    "run_on_ranks", "fake_world", "fake_mesh", "forget_dtensor_caches", "train_losses", "sgd_steps", "global_value", "error_of",
    "local_shapes", "assert_local_shapes", "input_shapes", "run_script",
]


@contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process as ``rank`` of a ``world_size``-rank world over PyTorch's ``fake`` process group
    (collectives return at once), for single-process tests and CPU-overhead benchmarks. A process
    group left over by an earlier test is torn down first; this one is torn down on exit."""
    register_fake_backend()

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextmanager
def fake_mesh(shape: tuple, names: tuple) -> Iterator:
    """A mesh of ``shape`` over a fake world of its size, with vescale's dispatch installed (and
    uninstalled on exit if it was not before): for single-process tests of DTensor ops."""
    from vescale import dispatch
    from vescale.mesh import init_mesh

    was_installed = dispatch.is_installed()
    with fake_world(math.prod(shape)):
        dispatch.install()
        try:
            yield init_mesh(shape, names)
        finally:
            if not was_installed:  # leave DTensor as the caller found it
                dispatch.uninstall()


def forget_dtensor_caches() -> None:
    """Clear DTensor's process-wide caches (sharding propagation, transform plans, redistribute
    planners), vescale.dispatch's (shape-free cache, sized-op table, view decisions, SDPA
    decisions) and vescale.comm's compiled moves (which hold process groups). Their keys do not
    include the rank, so entries made while this process simulated another rank (fake process
    group) would be wrong for a real rank forked from it."""
    from vescale._torch import _gen_transform_infos, clear_sharding_prop_cache, clear_redistribute_planner_cache

    from vescale.comm.moves import clear_moves
    from vescale.dispatch.fast import cache as shape_free
    from vescale.dispatch.coverage.attention import clear_sdpa_decisions
    from vescale.dispatch.fast.sized import clear_sized_ops_table
    from vescale.dispatch.fast.viewkey import clear_view_decisions

    clear_sharding_prop_cache()
    _gen_transform_infos.cache_clear()
    clear_redistribute_planner_cache()
    for cache in (*shape_free._INSTALLED, *shape_free._SET_ASIDE):  # vescale's cache in front of DTensor's miss path
        cache.clear()
    clear_sized_ops_table()
    clear_view_decisions()
    clear_sdpa_decisions()
    clear_moves()


def _start_afresh() -> None:
    """Reset the process-wide counts a forked rank inherits: optimiser steps and per-rank shares
    drawn (the step check compares them across ranks and names them in its errors)."""
    from vescale import data
    from vescale.parallel.faults import PROGRESS

    PROGRESS.reset()
    data._SHARES_DRAWN[0] = 0


def _store_host(world_size: int, conn) -> None:
    """Host the run's TCPStore (sends its port back) until the parent closes the pipe."""
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    conn.send(store.port)
    try:
        conn.recv()  # the parent's "stop", or EOFError if the parent died
    except EOFError:
        pass


def _child(rank: int, world_size: int, port: int, fn: Callable, args: tuple, conn) -> None:
    # The objects inherited from the parent (a test process holds ~300K: torch, transformers, ...)
    # live as long as this rank: out of the garbage collector's sight, a full collection does not
    # walk them (the first training step of a 4-rank tiny LLaMA: 1.4 -> 0.8 s of CPU).
    gc.freeze()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    # Each rank gets one intra-op thread: N ranks share this machine's few cores.
    torch.set_num_threads(1)
    forget_dtensor_caches()  # the parent may have simulated other ranks
    _start_afresh()  # the parent may have trained: this rank starts as a new process would
    try:
        if dist.is_initialized():  # the parent's group (a test's fake world), copied by fork: not this rank's
            dist.destroy_process_group()
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        result = fn(*args)
        # Plain pickle copies tensor data; multiprocessing's own pickler would pass storages by
        # file descriptor, which dies with this process.
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException:  # report everything, including assertion failures, to the parent
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0) -> list:
    """Call ``fn(*args)`` on ``world_size`` gloo ranks and return the list of per-rank results.

    ``fn`` runs after ``torch.distributed`` is initialised; ``dist.get_rank()`` tells it which rank
    it is. Results must be picklable. Raises ``RuntimeError`` carrying the first failing rank's
    traceback, or ``TimeoutError`` if any rank does not finish within ``timeout`` seconds.
    """
    ctx = mp.get_context("fork")  # fork: children inherit imports, so start-up costs milliseconds
    store_end, host_end = ctx.Pipe()
    host = ctx.Process(target=_store_host, args=(world_size, host_end), daemon=True)
    host.start()
    host_end.close()
    try:
        if not store_end.poll(60):
            raise TimeoutError("run_on_ranks: the store process did not start within 60 s")
        port = store_end.recv()
        return _run_children(ctx, port, fn, world_size, args, timeout)
    finally:
        # Tell the store process to return. Waiting for it to see the pipe closed is not enough:
        # it holds a copy of this end itself (fork), so it never would, and each run paid the 5 s
        # join timeout below before the kill.
        try:
            store_end.send("stop")
        except OSError:
            pass
        store_end.close()
        host.join(timeout=5)
        if host.is_alive():
            host.kill()


def _run_children(ctx, port: int, fn: Callable, world_size: int, args: tuple, timeout: float) -> list:
    pipes, procs = [], []
    for rank in range(world_size):
        parent_end, child_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(rank, world_size, port, fn, args, child_end))
        p.start()
        child_end.close()
        pipes.append(parent_end)
        procs.append(p)
    results, errors = [None] * world_size, []
    try:
        for rank, conn in enumerate(pipes):
            if not conn.poll(timeout):
                raise TimeoutError(f"rank {rank} did not finish within {timeout:.0f}s (hung collective?)")
            try:
                status, payload = pickle.loads(conn.recv_bytes())
            except EOFError:
                procs[rank].join(timeout=5)
                status, payload = "error", f"process died without reporting (exit code {procs[rank].exitcode})"
            if status == "error":
                errors.append(f"--- rank {rank} ---\n{payload}")
            else:
                results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("failure on {} rank(s):\n{}".format(len(errors), "\n".join(errors)))
    return results


def run_script(path: str, *argv: str) -> str:
    """Run the Python script at ``path`` as ``__main__`` in this process, with ``sys.argv`` set to
    ``[path, *argv]``, and return what it printed to stdout. With ``run_on_ranks`` it runs an example
    on gloo ranks as torchrun would (the environment variables torchrun sets are set, the process
    group already made) without starting an interpreter per rank. A ``SystemExit`` with a non-zero
    code is raised as a ``RuntimeError`` carrying the output."""
    printed, saved_argv = io.StringIO(), sys.argv
    sys.argv = [str(path), *map(str, argv)]
    try:
        with redirect_stdout(printed):
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise RuntimeError(f"{path} {' '.join(argv)} exited with {e.code!r}; it printed:\n{printed.getvalue()}") from None
    finally:
        sys.argv = saved_argv
    return printed.getvalue()


def train_losses(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                 opt: torch.optim.Optimizer) -> list[float]:
    """Train ``model`` on ``(input_ids, labels)`` batches (a causal LM returning ``.loss``) with the
    optimiser ``opt``, one step per batch; the losses, as global values (``loss.item()``)."""
    losses = []
    for input_ids, labels in batches:
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def global_value(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t``'s global value (a DTensor's full tensor; a plain tensor as it is)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def sgd_steps(model: torch.nn.Module, batches: Sequence[tuple], lr: float) -> dict:
    """One SGD step per batch of ``model(*batch)`` (a scalar loss): ``{"losses": [...], "grads":
    {parameter name: gradient}}``, as global values, the gradients of the last step (parameters
    without one left out). For comparing a parallelised model with the single device."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], {}
    for step, batch in enumerate(batches):
        loss = model(*batch)
        loss.backward()
        if step == len(batches) - 1:
            grads = {n: global_value(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(global_value(loss).item())
    return {"losses": losses, "grads": grads}


def error_of(fn: Callable[..., Any], *args: Any, kind: type[BaseException] = Exception) -> str | None:
    """The message of the ``kind`` exception ``fn(*args)`` raises, or None if it raises none (a test
    that expects the error then fails with the None, not with a traceback from a rank)."""
    try:
        fn(*args)
    except kind as e:
        return str(e)
    return None


# ---- split checks: equal losses cannot show that a plan split anything ----------------------------


def local_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape on this rank: a DTensor's local shard, a plain tensor whole."""
    from torch.distributed.tensor import DTensor

    return {
        name: tuple((p.to_local() if isinstance(p, DTensor) else p).shape) for name, p in module.named_parameters()
    }


def assert_local_shapes(module: torch.nn.Module, divisors: Mapping[str, tuple[int, ...]], label: str = "") -> None:
    """Assert that every parameter of ``module`` holds, on this rank, its global shape divided dim by
    dim by the ``divisors`` of the first pattern (a full-match regular expression over parameter
    names) it matches; a parameter no pattern matches must be whole. The expectation is the test's
    own statement of the split (not read from the plan), so a plan that silently replicates, or
    shards something else, fails here even when every loss matches one device. A pattern that
    matches no parameter is an error too (a stale expectation would check nothing)."""
    from torch.distributed.tensor import DTensor

    patterns = [(re.compile(p), p, tuple(d)) for p, d in divisors.items()]
    used, wrong = set(), []
    for name, param in module.named_parameters():
        full = tuple(param.shape)  # a DTensor's shape is the global one
        local = tuple((param.to_local() if isinstance(param, DTensor) else param).shape)
        split = next(((p, d) for rx, p, d in patterns if rx.fullmatch(name)), (None, (1,) * len(full)))
        used.add(split[0])
        div = split[1] + (1,) * (len(full) - len(split[1]))
        if len(div) != len(full) or any(n % k for n, k in zip(full, div)):
            raise ValueError(f"{label}: divisors {split[1]} do not split {name} of shape {full} evenly; state another expectation")
        want = tuple(n // k for n, k in zip(full, div))
        if local != want:
            wrong.append(f"{name}: local {local}, expected {want} (global {full} / {div})")
    stale = [p for _, p, _ in patterns if p not in used]
    if stale:
        raise ValueError(f"{label}: expected split pattern(s) {stale} match no parameter")
    assert not wrong, f"{label}: {len(wrong)} parameter(s) not split as expected:\n  " + "\n  ".join(wrong)


@contextmanager
def input_shapes(module: torch.nn.Module, *paths: str) -> Iterator[dict[str, list[tuple[int, ...]]]]:
    """Record, for each submodule path, the local shape of the first tensor its body receives
    (after the plan's hooks: a DTensor's local shard, a plain tensor as it is), one entry per call.
    For split checks: a data-parallel rank's layers must see its share of the batch, a sequence-
    parallel rank its share of the sequence."""
    from torch.distributed.tensor import DTensor

    seen: dict[str, list[tuple[int, ...]]] = {path: [] for path in paths}
    handles = []
    for path in paths:
        def record(mod: torch.nn.Module, args: tuple, kwargs: dict, path: str = path) -> None:
            first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
            if first is not None:
                seen[path].append(tuple((first.to_local() if isinstance(first, DTensor) else first).shape))

        handles.append(module.get_submodule(path).register_forward_pre_hook(record, with_kwargs=True))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()
