"""kill -9 of a rank under torchrun --max-restarts: the restarted job resumes with identical losses.

Runs examples/resume_training.py twice under ``torchrun --standalone --nproc-per-node 2`` (TP=2,
dropout on, a checkpoint after every step): once uninterrupted, once with rank 1 SIGKILLing itself
at step 3 of the first attempt. torchrun restarts both workers; ``vescale.init_mesh`` must join the
new attempt's rendezvous (without the per-attempt store prefix the restarted workers fail in gloo's
connectFullMesh after minutes) and the resumed run must report the same six losses bit for bit.
A subprocess time limit makes a hang fail the test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "resume_training.py"


def _torchrun(tmp: Path, name: str, *extra: str) -> dict:
    out = tmp / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", str(SCRIPT), "--ckpt", str(tmp / name), "--out", str(out), "--timeout", "30", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.multiproc
def test_killed_rank_restarts_and_resumes_with_identical_losses(tmp_path):
    clean = _torchrun(tmp_path, "clean")
    killed = _torchrun(tmp_path, "killed", "--kill-at", "3", "--kill-rank", "1")
    assert clean["restarts"] == 0 and killed["restarts"] == 1  # the kill really restarted the job
    assert len(clean["losses"]) == 6
    assert killed["losses"] == clean["losses"]
    # keep_last=2: only the two newest checkpoints remain
    assert sorted(p.name for p in (tmp_path / "killed").glob("step_*")) == ["step_00000005", "step_00000006"]
