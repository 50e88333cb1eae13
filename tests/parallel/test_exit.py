"""Runs that succeed exit with status 0: no abort at interpreter exit (issue 29).

A gloo worker thread that releases a collective's tensors while the interpreter is being torn down
aborts the process ("terminate called without an active exception", SIGABRT; see
``vescale.mesh.GroupTeardown``). ``scripts/exit_loop.py`` launches a short training run under
torchrun again and again and counts the runs that fail. Each run here leaves 10 all-gathers unwaited
at exit, the worst case: with PyTorch alone (``--plain``) 3 to 9 of 20-30 such launches aborted.

The 50-run check is marked ``slow`` (deselected by default; ``pytest -m slow tests/parallel/test_exit.py``,
about 50 torchrun launches, ~10 s each on an idle machine); so is the single launch (CI's torchrun
launches, the README demo's among them, must exit with status 0 too).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "exit_loop.py")


def _exit_loop():
    spec = importlib.util.spec_from_file_location("exit_loop", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.multiproc
def test_a_run_exits_cleanly():
    failures = _exit_loop().run_loop(1, nproc=2, extra=("--steps=2", "--unwaited=10"), verbose=False)
    assert not failures, failures


@pytest.mark.slow
@pytest.mark.multiproc
def test_fifty_runs_exit_cleanly():
    failures = _exit_loop().run_loop(50, nproc=2, extra=("--steps=2", "--unwaited=10"), verbose=False)
    assert not failures, failures
