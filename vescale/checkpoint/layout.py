"""Where checkpoints live on disk: one folder per step under a checkpoint root, a ``latest`` pointer,
atomic publication and keep-last-N.

    <root>/
      latest                  # text: the folder name of the newest complete checkpoint
      step_00000003/          # a DCP checkpoint (.metadata, __<rank>_0.distcp) + vescale.pt
      step_00000006/
      .tmp-step_00000009/     # a save in progress (or one that crashed): never read

A checkpoint is written into ``.tmp-<name>`` and renamed to ``<name>`` only once every rank has
written its part and the coordinator has written DCP's ``.metadata`` and vescale's own ``vescale.pt``;
``latest`` is replaced with ``os.replace`` afterwards. A crash at any point therefore leaves either
the previous ``latest`` or the new one pointing at a complete folder. Rename and replace are atomic on
POSIX file systems; the root must be one file system shared by all ranks (a local disk for a single
node, or a shared mount).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

__all__ = ["step_name", "temp_name", "is_complete", "latest", "candidates", "complete_steps", "publish", "prune", "SIDE_FILE"]

SIDE_FILE = "vescale.pt"  # step, extras and RNG states; written last by the coordinator
_STEP_RE = re.compile(r"^step_(\d+)$")


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def temp_name(step: int) -> str:
    return f".tmp-{step_name(step)}"


def is_complete(folder: Path) -> bool:
    """A published checkpoint folder: DCP's metadata and vescale's side file are both there."""
    return (folder / ".metadata").is_file() and (folder / SIDE_FILE).is_file()


def complete_steps(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under ``root``, oldest first."""
    found = []
    if root.is_dir():
        for child in root.iterdir():
            m = _STEP_RE.match(child.name)
            if m and is_complete(child):
                found.append((int(m.group(1)), child))
    return sorted(found)


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root``: the one ``latest`` names, or (if the pointer is
    missing or names an incomplete folder) the complete ``step_*`` folder with the highest step.
    ``root`` may also be a checkpoint folder itself. None when there is none."""
    root = Path(root)
    if is_complete(root):
        return root
    pointer = root / "latest"
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named.name and is_complete(named):
            return named
    steps = complete_steps(root)
    return steps[-1][1] if steps else None


def candidates(root: str | os.PathLike) -> list[Path]:
    """The complete checkpoints under ``root``, in the order a load tries them: the one ``latest``
    names (if complete), then the others from the highest step down (the fallbacks of a load that
    finds the first corrupt)."""
    root = Path(root)
    first = latest(root)
    if first is None:
        return []
    rest = [p for _, p in reversed(complete_steps(root)) if p.resolve() != first.resolve()]
    return [first, *rest]


def publish(root: Path, step: int) -> Path:
    """Coordinator only: rename the finished temp folder to its final name, then point ``latest``
    at it. An older folder of the same step (a re-save) is replaced."""
    final, temp = root / step_name(step), root / temp_name(step)
    if final.exists():
        # Re-saving a step: move the old one aside first so a crash never leaves no checkpoint.
        old = root / f".old-{step_name(step)}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(temp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(temp, final)
    tmp_pointer = root / ".latest.tmp"
    tmp_pointer.write_text(final.name + "\n")
    _fsync(tmp_pointer)
    os.replace(tmp_pointer, root / "latest")
    return final


def prune(root: Path, keep_last: int) -> list[Path]:
    """Coordinator only: delete all but the newest ``keep_last`` complete checkpoints; returns them."""
    steps = complete_steps(root)
    doomed = [p for _, p in steps[:-keep_last]] if keep_last > 0 else []
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def _fsync(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
