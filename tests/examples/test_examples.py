"""The README's demo and the examples run, shortened (``--steps 2``), and say what their docs say.

* ``scripts/demo.sh --steps 2`` (the README's first command, as written: its own set-up step, which
  skips pip when nothing changed, then ``examples/train_llama.py`` on one device and under
  ``torchrun`` on 4 ranks, ``examples/compare_losses.py`` and ``python -m vescale.debug.compare``):
  exit 0, both comparisons report agreement, the plot is written.
* ``examples/train_moe.py`` on one device and on DP=2 x TP=2 + ZeRO-3 and EP=2 (forked gloo ranks
  running the script as torchrun would): the per-step losses agree within 1e-5 (its docstring:
  "the single-device ones up to float32 rounding"; printed with 6 decimals).
* ``examples/record_compare.py`` as docs/debug.md runs it: one device and TP=2 agree (exit 0),
  TP=2 with another dropout seed parts first at ``layers.0.down`` (exit 1), as the page shows.

``examples/debug_breakpoint.py`` is driven through its pdb session in tests/debug/test_breakpoint.py,
``examples/resume_training.py`` under torchrun restarts in tests/checkpoint/test_restart.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vescale.debug.comparing import main as compare_main
from vescale.testing import run_on_ranks, run_script

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


@pytest.mark.multiproc
def test_demo_script_runs_short(tmp_path):
    out = tmp_path / "demo"
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "demo.sh"), "--steps", "2"], cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "VESCALE_DEMO_OUT": str(out)}, timeout=900,
    )
    text = done.stdout + done.stderr
    assert done.returncode == 0, text
    assert "OK: max |diff|" in text and "OK: the runs agree" in text, text
    assert (out / "losses.png").stat().st_size > 0


def _losses(printed: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", printed, flags=re.M)]


def _train_moe(*argv: str) -> str:
    return run_script(EXAMPLES / "train_moe.py", *argv)


@pytest.mark.multiproc
def test_train_moe_matches_one_device():
    single = _losses(run_on_ranks(_train_moe, 1, "--steps", "2")[0])
    assert len(single) == 2, single
    for world, argv in [(4, ["--mesh", "DP=2,TP=2", "--zero3"]), (2, ["--mesh", "EP=2", "--kernel", "eager"])]:
        got = _losses(run_on_ranks(_train_moe, world, *argv, "--steps", "2")[0])
        assert len(got) == 2 and all(abs(a - b) <= 1e-5 for a, b in zip(got, single)), (argv, got, single)


def _record_compare(*argv: str) -> str:
    return run_script(EXAMPLES / "record_compare.py", *argv)


@pytest.mark.multiproc
def test_record_compare_finds_what_docs_debug_md_shows(tmp_path, capsys):
    runs = {name: str(tmp_path / name) for name in ("single", "tp", "tp_seed1")}
    run_on_ranks(_record_compare, 1, "single", runs["single"])
    run_on_ranks(_record_compare, 2, "tp", runs["tp"])
    run_on_ranks(_record_compare, 2, "tp", runs["tp_seed1"], "--seed", "1")
    assert compare_main([runs["single"], runs["tp"]]) == 0
    agree = capsys.readouterr().out
    assert "56 tensors over 2 step(s)" in agree and "OK: the runs agree" in agree, agree
    # One real command line, as the page runs it (the others through main()).
    differ = subprocess.run([sys.executable, "-m", "vescale.debug.compare", runs["single"], runs["tp_seed1"]],
                            capture_output=True, text=True, timeout=300)
    assert differ.returncode == 1, differ.stdout + differ.stderr
    assert "FIRST DIFFERENCE: step 0, output of module 'layers.0.down' (call 0)" in differ.stdout, differ.stdout
