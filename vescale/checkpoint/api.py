"""save() / load(): checkpoints of a parallelised (or plain) model on top of PyTorch DCP.

What goes where:

* ``torch.distributed.checkpoint`` (DCP) holds the model's and the optimiser's state dicts, taken
  with ``get_model_state_dict`` / ``get_optimizer_state_dict``: every rank writes only its own shards
  of each DTensor, a replicated tensor is written once, and a load reads whatever chunks the
  *loading* model's placements need — so a checkpoint saved on one mesh and plan loads on any other,
  including a plain single-device model.
* ``vescale.pt`` (written by rank 0, last) holds the step, the user's extras, vescale's RNG state
  (the same on every rank) and every rank's PyTorch RNG states (CPU and, if present, CUDA).

The folder layout, the atomic publication and keep-last-N are in ``layout.py``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import os
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torch.distributed.tensor import DTensor
from vescale._torch import tree_map_only

from ..mesh import TEARDOWN, apply_run_timeout
from ..parallel.faults import _first_line
from ..parallel.state import checkpointable
from . import integrity, layout
from .integrity import CheckpointCorruptError

__all__ = ["save", "load", "wait", "AsyncCheckpoint", "CheckpointCorruptError"]

_FORMAT = 2  # 2: the folder holds checksums.json (every file's CRC-32)
_pending: list["AsyncCheckpoint"] = []  # at most one async save in flight per process
_async_group: list = []  # the process group async saves communicate on (made once, lazily)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _state(model: nn.Module, optimizer) -> dict:
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        # Optimiser state of an InterleavedShard parameter is laid out like it, which DCP cannot
        # describe: save (and load into) the same global tensor laid out as Shard.
        # A copy of the containers: the per-parameter state dicts are the optimiser's own, and an
        # in-place relayout would leave the optimiser stepping on Shard-laid-out state.
        state["optim"] = tree_map_only(DTensor, checkpointable, get_optimizer_state_dict(model, optimizer))
    return state


def _relayout_optimizer_state(optimizer) -> None:
    """After loading: each state tensor of a parameter's shape laid out like its parameter again
    (vescale steps elementwise optimisers on local shards, which needs the same layout)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                same_tensor = isinstance(value, DTensor) and isinstance(p, DTensor) and value.shape == p.shape
                if same_tensor and value.placements != p.placements:
                    optimizer.state[p][key] = value.redistribute(p.device_mesh, p.placements)


def _rng_states() -> dict:
    """This rank's PyTorch generators (they may differ per rank) and vescale's (the same everywhere).

    Under vescale's SPMD contract every rank's PyTorch generators hold the same state (one seed,
    the same draws), so one copy is kept, after one fixed-size all-reduce that checks it: a
    checkpoint's cost does not grow with the world. Ranks whose states differ (a program that draws
    per rank) keep every rank's, gathered (rank 0 writes them)."""
    from .. import random as vescale_random

    mine = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        mine["cuda"] = torch.cuda.get_rng_state()
    everyone = [mine]
    if _distributed() and not _same_on_every_rank(_digest(b"".join(v.numpy().tobytes() for v in mine.values()))):
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    try:
        vescale_state = vescale_random.get_state()
    except RuntimeError:  # never seeded: nothing to restore
        vescale_state = None
    return {"torch": everyone, "vescale": vescale_state}


def _digest(data: bytes) -> list[int]:
    """112 bits of a hash of ``data`` as two non-negative int64 values (safe to negate)."""
    h = hashlib.blake2b(data, digest_size=14).digest()
    return [int.from_bytes(h[:7], "little"), int.from_bytes(h[7:], "little")]


def _same_on_every_rank(values: list[int]) -> bool:
    """Whether every rank passed the same ``values`` (one all-reduce of ``[v, -v]`` with MAX gives
    every rank the maximum and minus the minimum)."""
    both = torch.tensor(values + [-v for v in values], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        both = both.cuda()
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    high, neg_low = both.cpu().tolist()[: len(values)], both.cpu().tolist()[len(values):]
    return high == [-v for v in neg_low]


def _next_step(root: Path) -> int:
    steps = layout.complete_steps(root)
    return steps[-1][0] + 1 if steps else 0


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    keep_last: int | None = None,
    async_save: bool = False,
    **extra: Any,
) -> Path | "AsyncCheckpoint":
    """Save checkpoint ``step`` of ``model`` (and ``optimizer``) under the folder ``path``; call on every rank.

    Saves the model's and optimiser's state (each rank its own shards, through DCP), vescale's and
    PyTorch's RNG states, ``step`` and ``extra`` (any picklable values, e.g. a data-loader position);
    ``load`` returns ``{"step": step, **extra}``. ``step`` defaults to the latest saved step + 1 (0 for
    the first). The checkpoint appears as ``path/step_<step>`` only when complete, and ``path/latest``
    then names it: a crash mid-save leaves the previous checkpoint in place and loadable.
    ``keep_last=N`` deletes all but the newest N checkpoints after publishing this one.

    ``async_save=True`` copies the state to CPU memory and writes it in a background thread (DCP's
    ``async_save``, on a process group of its own) and returns an ``AsyncCheckpoint``; training may
    go on at once. The checkpoint is published when the write finishes; ``wait()`` (or the next
    ``save`` / ``load``) waits for it and raises its error, if any. Returns the checkpoint folder.
    """
    wait()
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"checkpoint.save: keep_last must be a positive int or None, got {keep_last!r}")
    root = Path(path)
    if step is None:
        step = _next_step(root)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"checkpoint.save: step must be a non-negative int, got {step!r}")
    temp = root / layout.temp_name(step)
    if _rank() == 0:  # a temp folder left by a crashed save of the same step
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir(parents=True)
    _barrier()
    side = {"format": _FORMAT, "step": step, "extra": extra, "rng": _rng_states(),
            "world_size": dist.get_world_size() if _distributed() else 1}
    state = _state(model, optimizer)
    side_sum = _write_side_file(side, temp) if _rank() == 0 else None  # complete only with DCP's .metadata
    writer = integrity.ChecksumWriter(temp)
    if async_save:
        handle = AsyncCheckpoint(root, step, keep_last, _start_async(state, writer, temp, side_sum))
        _pending.append(handle)
        return handle
    dcp.save(state, storage_writer=writer, no_dist=not _distributed())
    # DCP's coordinator (rank 0) wrote .metadata only after every rank reported its writes done.
    _write_manifest(temp, writer, side_sum, group=None)
    final = _finish(root, step, keep_last) if _rank() == 0 else root / layout.step_name(step)
    _barrier()  # when save returns, every rank sees the published checkpoint
    return final


def _write_side_file(side: dict, temp: Path) -> dict:
    buffer = io.BytesIO()
    torch.save(side, buffer)
    data = buffer.getvalue()
    with open(temp / layout.SIDE_FILE, "wb") as f:
        f.write(data)
    return integrity.crc32_of_bytes(data)


def _write_manifest(temp: Path, writer: integrity.ChecksumWriter, side_sum: dict | None, group) -> None:
    """Gather the checksums of the files every rank wrote; the coordinator lists them all (with
    ``vescale.pt``'s) in the manifest, before the folder is published."""
    mine = writer.sums
    if _distributed():
        everyone: list | None = [None] * dist.get_world_size(group) if _rank() == 0 else None
        dist.gather_object(mine, everyone, dst=0, group=group)
    else:
        everyone = [mine]
    if _rank() == 0:
        sums = {name: value for part in everyone for name, value in part.items()}
        sums[layout.SIDE_FILE] = side_sum
        integrity.write_manifest(temp, sums)


def _finish(root: Path, step: int, keep_last: int | None) -> Path:
    final = layout.publish(root, step)
    if keep_last is not None:
        layout.prune(root, keep_last)
    return final


_manifest_thread: list = []  # one worker thread that writes async saves' manifests (made lazily)


def _start_async(state: dict, writer: integrity.ChecksumWriter, temp: Path, side_sum: dict | None):
    """DCP's async save, then (in a thread of ours, once DCP's write finished) the manifest: the
    returned future completes when the checkpoint is ready to publish."""
    group = None
    if not _distributed():
        future = dcp.async_save(state, storage_writer=writer, no_dist=True)
    else:
        if not _async_group:
            # The writer thread runs DCP's collectives while the main thread trains: on the default
            # group the two streams of collectives would interleave and pair wrongly.
            made = dist.new_group(backend="gloo")
            apply_run_timeout(made)  # a new group starts with gloo's 30 minutes, not the run's timeout
            TEARDOWN.track(made)
            _async_group.append(made)
        group = _async_group[0]
        future = dcp.async_save(state, storage_writer=writer, process_group=group)
    written = getattr(future, "upload_completion", future)
    if not _manifest_thread:
        _manifest_thread.append(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vescale-checkpoint"))

    def manifest() -> None:
        written.result()
        _write_manifest(temp, writer, side_sum, group)

    return _manifest_thread[0].submit(manifest)


class AsyncCheckpoint:
    """A checkpoint being written in the background (``save(..., async_save=True)``)."""

    def __init__(self, root: Path, step: int, keep_last: int | None, future: concurrent.futures.Future) -> None:
        self.root, self.step, self.keep_last = root, step, keep_last
        self._future = getattr(future, "upload_completion", future)
        self._lock = threading.Lock()
        self._path: Path | None = None

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> Path:
        """Wait until written and published (rank 0 publishes; every rank waits for its own part)."""
        with self._lock:
            if self._path is None:
                self._future.result()  # raises the writer's error
                if _rank() == 0:
                    self._path = _finish(self.root, self.step, self.keep_last)
                else:
                    self._path = self.root / layout.step_name(self.step)
        return self._path


def wait() -> Path | None:
    """Wait for this process's async save in flight, if any; returns its folder. Every rank must call
    it (``save`` and ``load`` do) so that all see the checkpoint published."""
    if not _pending:
        return None
    handle = _pending.pop()
    try:
        return handle.wait()
    finally:
        _barrier()


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    verify: bool = True,
    fallback: bool = True,
) -> dict[str, Any]:
    """Load the latest complete checkpoint under ``path`` (or the checkpoint folder ``path``) into
    ``model`` (and ``optimizer``), restore vescale's and PyTorch's RNG states, and return
    ``{"step": step, **extra}``. Call on every rank.

    The model may be parallelised with any plan on any mesh, or be a plain single-device model: DCP
    reads the chunks each rank's placements need. PyTorch's RNG states are restored: the one state every
    rank had when saved, or each rank's own where they differed and the world size is the one saved
    (else rank 0's).

    ``verify=True`` checks every file of the checkpoint against the CRC-32 recorded when it was saved
    (the ranks share the reading, each file is read once) before loading it. A checkpoint with a
    corrupt, truncated or missing file, or one the storage layer cannot read, is skipped with a
    warning naming the files, and the newest older complete checkpoint under ``path`` is loaded
    instead; every rank makes the same choice. ``fallback=False`` (or ``path`` naming one checkpoint
    folder) raises ``CheckpointCorruptError`` instead.
    """
    wait()
    root = Path(path)
    candidates = [root] if layout.is_complete(root) else layout.candidates(root)
    if not candidates:
        raise FileNotFoundError(
            f"checkpoint.load: no complete checkpoint under {str(root)!r} (looked for a 'latest' pointer "
            "and step_* folders holding .metadata and vescale.pt); save one with vescale.checkpoint.save"
        )
    _check_same_folder(candidates[0])
    skipped = []
    for folder in candidates:
        problems = _problems(folder, verify)
        if not problems:
            try:
                return _load_folder(folder, model, optimizer)
            except _Unreadable as e:
                problems = [str(e)]
        skipped.append((folder, problems))
        if not fallback or folder is candidates[-1]:
            break
        if _rank() == 0:
            warnings.warn(
                f"checkpoint.load: {folder} is corrupt ({'; '.join(problems[:3])}"
                f"{f'; and {len(problems) - 3} more' if len(problems) > 3 else ''}); loading the newest older "
                f"checkpoint instead ({candidates[candidates.index(folder) + 1]})",
                stacklevel=2,
            )
    lines = "\n".join(f"  {folder}: " + "; ".join(problems) for folder, problems in skipped)
    hint = (
        "no older complete checkpoint is left to fall back to" if fallback
        else "load(..., fallback=True) would fall back to the newest intact older checkpoint"
    )
    raise CheckpointCorruptError(f"checkpoint.load: the checkpoint is corrupt:\n{lines}\n({hint})")


class _Unreadable(Exception):
    """The storage layer failed to read a checkpoint that passed (or had no) checksums."""


def _problems(folder: Path, verify: bool) -> list[str]:
    """Every rank's findings on ``folder`` (the same list on every rank)."""
    mine: list[str] = []
    if verify:
        try:
            files = integrity.read_manifest(folder)
        except CheckpointCorruptError as e:
            mine = [str(e)]
        else:
            if files is not None:
                mine = integrity.verify(folder, files, _rank(), dist.get_world_size() if _distributed() else 1)
    return _everyone(mine)


def _everyone(mine: list[str]) -> list[str]:
    if not _distributed():
        return mine
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return sorted({p for part in everyone for p in part})


def _load_folder(folder: Path, model: nn.Module, optimizer) -> dict[str, Any]:
    try:
        side = torch.load(folder / layout.SIDE_FILE, weights_only=False)
        has_optimizer = _has_optimizer(folder)
        error = ""
    except Exception as e:  # unreadable side file or metadata: every rank reads the same bytes
        side, has_optimizer, error = None, False, f"{folder}: cannot be read ({type(e).__name__}: {_first_line(e)})"
    errors = _everyone([error] if error else [])
    if errors:
        raise _Unreadable(errors[0])
    if optimizer is not None and not has_optimizer:
        raise ValueError(
            f"checkpoint.load: {folder} was saved without an optimizer; load it without optimizer= "
            "(the optimiser then starts fresh), or save with save(..., optimizer)"
        )
    state = _state(model, optimizer)
    try:
        # DCP gathers every rank's read errors and raises on all ranks alike.
        dcp.load(state, checkpoint_id=folder, no_dist=not _distributed())
    except Exception as e:
        raise _Unreadable(f"{folder}: DCP cannot read it ({type(e).__name__}: {_first_line(e)})") from e
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
        _relayout_optimizer_state(optimizer)
    _restore_rng(side["rng"])
    return {"step": side["step"], **side["extra"]}


def _has_optimizer(folder: Path) -> bool:
    keys = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    return any(k.startswith("optim.") for k in keys)


def _check_same_folder(folder: Path) -> None:
    """Every rank must read the same checkpoint (a root that is not one shared file system would not).
    One fixed-size all-reduce of the path's checksum; the names are gathered only to explain a
    mismatch."""
    if not _distributed():
        return
    name = str(folder.resolve())
    if _same_on_every_rank(_digest(name.encode())):
        return
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, name)
    raise RuntimeError(
        f"checkpoint.load: ranks found different latest checkpoints ({sorted(set(names))}); the "
        "checkpoint folder must be one file system shared by all ranks"
    )


def _restore_rng(rng: dict) -> None:
    from .. import random as vescale_random

    if rng["vescale"] is not None:
        vescale_random.set_state(rng["vescale"])
    states = rng["torch"]
    world = dist.get_world_size() if _distributed() else 1
    mine = states[_rank()] if len(states) == world else states[0]
    torch.set_rng_state(mine["cpu"])
    if "cuda" in mine and torch.cuda.is_available():
        torch.cuda.set_rng_state(mine["cuda"])
