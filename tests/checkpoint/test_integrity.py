"""Corrupt checkpoints: found by their checksums, named, and skipped for the newest intact one.

Two ranks (DP=2 + ZeRO-3: each rank writes its own shard file) save steps 1-3 of the tiny LLaMA,
steps 2 and 3 asynchronously, keeping the last 2. Then one file of step 3 is damaged in each of the
ways a disk or a crash damages files (64 flipped bytes, a truncated or deleted shard, a truncated
``.metadata`` or ``vescale.pt``, a garbled checksum list) and every rank loads into a fresh model:
each must get step 2's state exactly (``torch.equal`` on every parameter and AdamW moment, gathered),
the same step on both ranks, and a warning that names the damaged file; ``fallback=False`` must
raise ``CheckpointCorruptError`` naming it. Without checksums, the flipped bytes loaded step 3
silently with a wrong ``exp_avg`` (the issue's finding), so these tests fail on the old code.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from vescale import checkpoint
from vescale.checkpoint import CheckpointCorruptError
from vescale.testing import global_value, run_on_ranks

from ckpt_common import build, train

DAMAGES = ("flip", "truncate", "delete", "metadata", "side", "manifest")


def _damage(folder: Path, how: str) -> str:
    """Damage one file of ``folder``; returns its name."""
    name = {"flip": "__1_0.distcp", "truncate": "__0_0.distcp", "delete": "__1_0.distcp",
            "metadata": ".metadata", "side": "vescale.pt", "manifest": "checksums.json"}[how]
    path = folder / name
    data = bytearray(path.read_bytes())
    if how == "flip":
        middle = len(data) // 2
        data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
        path.write_bytes(bytes(data))
    elif how == "delete":
        path.unlink()
    elif how == "manifest":
        path.write_text("{not json")
    else:
        path.write_bytes(bytes(data[: len(data) // 2]))
    return name


def _state(model, opt) -> dict:
    """Every parameter and optimiser tensor as global values (a collective)."""
    values = {f"param:{n}": global_value(p) for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                values[f"{key}:{names[id(p)]}"] = global_value(value)
    return values


def _corrupt_and_load(root: str) -> dict:
    base = Path(root) / "base"
    model, opt = build((2,), ("DP",), zero3=True)
    train(model, opt, 0, 1)
    checkpoint.save(base, model, opt, step=1, keep_last=2)
    train(model, opt, 1, 2)
    checkpoint.save(base, model, opt, step=2, keep_last=2, async_save=True)
    expected = _state(model, opt)  # what step 2 holds
    train(model, opt, 2, 3)
    checkpoint.save(base, model, opt, step=3, keep_last=2, async_save=True)
    checkpoint.wait()
    kept = sorted(p.name for p in base.iterdir() if p.name.startswith("step_"))

    rank = dist.get_rank()
    results = {"kept": kept}
    for how in DAMAGES:
        here = Path(root) / how
        if rank == 0:
            shutil.copytree(base, here)
            results.setdefault("damaged", {})[how] = _damage(here / "step_00000003", how)
        dist.barrier()
        model, opt = build((2,), ("DP",), zero3=True, seed=7)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = checkpoint.load(here, model, opt)["step"]
        loaded = _state(model, opt)
        same = sorted(k for k in expected if torch.equal(expected[k], loaded[k]))
        try:
            checkpoint.load(here, model, opt, fallback=False)
            refused = None
        except CheckpointCorruptError as e:
            refused = str(e)
        results[how] = {
            "step": step, "same": len(same), "total": len(expected),
            "warnings": [str(w.message) for w in caught if "corrupt" in str(w.message)], "refused": refused,
        }
    return results


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    return run_on_ranks(_corrupt_and_load, 2, str(tmp_path_factory.mktemp("integrity")), timeout=600)


@pytest.mark.multiproc
@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_checkpoint_falls_back_to_the_newest_intact_one(damaged, how):
    r0, r1 = damaged
    assert r0["kept"] == ["step_00000002", "step_00000003"]  # keep_last=2 with async saves
    name = r0["damaged"][how]
    for rank, r in enumerate(damaged):
        got = r[how]
        assert got["step"] == 2, (rank, got)  # every rank took the same, intact checkpoint
        assert got["same"] == got["total"] > 0, (rank, got)  # step 2's weights and AdamW moments, exactly
        assert got["refused"] is not None and name in got["refused"] and "step_00000003" in got["refused"], got
    # one warning (rank 0 warns) naming the damaged file and the checkpoint loaded instead
    assert len(r0[how]["warnings"]) == 1 and name in r0[how]["warnings"][0], r0[how]
    assert "step_00000002" in r0[how]["warnings"][0]


def test_one_process_flip_and_truncation_are_named(tmp_path):
    """No process group: the same checks in one process (save, damage, load, export)."""
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    checkpoint.save(tmp_path, model, opt, step=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        model.weight.add_(1.0)
    checkpoint.save(tmp_path, model, opt, step=2)
    files = sorted(os.listdir(tmp_path / "step_00000002"))
    assert "checksums.json" in files, files

    shard = next(f for f in files if f.endswith(".distcp"))
    path = tmp_path / "step_00000002" / shard
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    path.write_bytes(bytes(data))

    fresh = torch.nn.Linear(64, 64)
    with pytest.warns(UserWarning, match=rf"step_00000002.*{shard}.*CRC-32.*step_00000001"):
        assert checkpoint.load(tmp_path, fresh)["step"] == 1
    assert all(torch.equal(before[n], p) for n, p in fresh.named_parameters())
    with pytest.raises(CheckpointCorruptError, match=rf"{shard}: CRC-32"):
        checkpoint.export(tmp_path)
    with pytest.raises(CheckpointCorruptError, match=rf"{shard}: CRC-32"):
        checkpoint.load(tmp_path / "step_00000002", fresh)  # one folder named: nothing to fall back to

    path.write_bytes(bytes(data[:10]))
    with pytest.raises(CheckpointCorruptError, match=rf"{shard}: 10 bytes, \d+ when saved"):
        checkpoint.load(tmp_path, fresh, fallback=False)


def test_a_checkpoint_without_checksums_still_loads(tmp_path):
    """Checkpoints saved before checksums were recorded have no checksums.json: loaded unverified."""
    model = torch.nn.Linear(8, 8)
    checkpoint.save(tmp_path, model, step=4, note="old")
    (tmp_path / "step_00000004" / "checksums.json").unlink()
    assert checkpoint.load(tmp_path, torch.nn.Linear(8, 8)) == {"step": 4, "note": "old"}
