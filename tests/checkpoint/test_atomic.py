"""A crash during save leaves the previous checkpoint loadable; latest and keep-last-N.

The crash is real: a child process (forked) saves step 1, then starts saving step 2 and is killed with
SIGKILL while writing DCP's shard files, or after everything is written but before the folder is
published. The parent then loads: it must get step 1's values, ignore the half-written folder,
and a later save of step 2 must succeed over the debris.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from vescale import checkpoint
from vescale.testing import run_on_ranks

def _save_then_hang(root: Path, where: str) -> None:
    """The child: saves step 1, then hangs in the middle of saving step 2 (where the parent kills it)."""
    import torch.distributed.checkpoint.filesystem as fs

    from vescale.checkpoint import layout

    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(1.0)
    checkpoint.save(root, model, step=1, note="first")
    with torch.no_grad():
        model.weight.fill_(2.0)

    def hang():
        (root / "crash-point").write_text(where)
        time.sleep(600)

    if where == "write":
        def write_data(self, plan, planner):
            (root / layout.temp_name(2) / "__0_0.distcp").write_bytes(b"partial")
            hang()
        fs.FileSystemWriter.write_data = write_data  # the child's own copy of the class: it dies with it
    else:
        original = layout.os.replace

        def replace(src, dst):
            if Path(src).name == layout.temp_name(2):
                hang()
            return original(src, dst)
        layout.os.replace = replace
    checkpoint.save(root, model, step=2, note="second")
    os._exit(0)  # not reached: killed while hanging


def _weight(model) -> float:
    return model.weight.detach()[0, 0].item()


@pytest.mark.parametrize("where", ["write", "publish"])
def test_kill_during_save_keeps_previous_checkpoint(tmp_path, where):
    # A forked child (it inherits the test process's imports; a fresh interpreter cost ~10 s of CPU)
    child = multiprocessing.get_context("fork").Process(target=_save_then_hang, args=(tmp_path, where))
    child.start()
    try:
        deadline = time.time() + 120
        while not (tmp_path / "crash-point").exists():
            assert child.is_alive(), f"child exited early with {child.exitcode}"
            assert time.time() < deadline, "child never reached the crash point"
            time.sleep(0.1)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.join(timeout=30)
    assert child.exitcode == -signal.SIGKILL
    assert (tmp_path / ".tmp-step_00000002").is_dir()  # the debris is really there
    model = torch.nn.Linear(4, 4)
    assert checkpoint.load(tmp_path, model) == {"step": 1, "note": "first"}
    assert _weight(model) == 1.0
    assert checkpoint.latest(tmp_path).name == "step_00000001"

    with torch.no_grad():
        model.weight.fill_(3.0)
    checkpoint.save(tmp_path, model, step=2)  # over the debris
    fresh = torch.nn.Linear(4, 4)
    assert checkpoint.load(tmp_path, fresh)["step"] == 2 and _weight(fresh) == 3.0
    assert not (tmp_path / ".tmp-step_00000002").exists()


def test_latest_pointer_keep_last_and_default_step(tmp_path):
    model = torch.nn.Linear(2, 2)
    for value in range(4):
        with torch.no_grad():
            model.weight.fill_(float(value))
        checkpoint.save(tmp_path, model, keep_last=2)  # steps 0, 1, 2, 3 by default
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000002", "step_00000003"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000003"
    fresh = torch.nn.Linear(2, 2)
    assert checkpoint.load(tmp_path, fresh)["step"] == 3 and _weight(fresh) == 3.0
    # A checkpoint folder itself can be loaded; a missing pointer falls back to the newest folder.
    assert checkpoint.load(tmp_path / "step_00000002", fresh)["step"] == 2 and _weight(fresh) == 2.0
    (tmp_path / "latest").unlink()
    assert checkpoint.load(tmp_path, fresh)["step"] == 3
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        checkpoint.load(tmp_path / "nothing-here", fresh)
    with pytest.raises(ValueError, match="saved without an optimizer; load it without optimizer="):
        checkpoint.load(tmp_path, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))


def _failing_rank_save(root: str) -> str:
    import torch.distributed.checkpoint.filesystem as fs

    model = torch.nn.Linear(4, 4)
    torch.nn.init.constant_(model.weight, 1.0)
    checkpoint.save(root, model, step=1)
    if dist.get_rank() == 1:
        def write_data(self, plan, planner):
            raise OSError("disk full (simulated on rank 1)")
        fs.FileSystemWriter.write_data = write_data
    torch.nn.init.constant_(model.weight, 2.0)
    try:
        checkpoint.save(root, model, step=2)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        error = str(e)
    else:
        error = "no error"
    torch.nn.init.constant_(model.weight, 0.0)
    step = checkpoint.load(root, model)["step"]
    return f"{step} {_weight(model)} {'disk full' in error}"


@pytest.mark.multiproc
def test_rank_failing_during_save_leaves_previous_checkpoint(tmp_path):
    assert run_on_ranks(_failing_rank_save, 2, str(tmp_path), timeout=120) == ["1 1.0 True"] * 2
