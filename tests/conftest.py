"""Suite-wide settings: reproducible Hypothesis runs and tests that leave PyTorch as they found it.

* Hypothesis runs under the ``ci`` profile: ``derandomize=True`` (each property test draws the same
  examples on every run, derived from the test itself, so CI is reproducible and a failure is the
  same failure on the next run) and ``print_blob=True`` (a failure prints the falsifying example
  and a ``@reproduce_failure(...)`` line that replays it). ``pytest --hypothesis-profile explore``
  draws fresh random examples instead (kept in ``.hypothesis/`` for replay), for hunting bugs
  locally; a failure found that way prints its blob too.
* Every test leaves DTensor's thread-local implicit replication (which ``vescale.parallelize``
  switches on for the calling thread, as its contract says) and vescale's extensions of DTensor
  (``vescale.dispatch.install`` / ``vescale.random`` install, both done by ``parallelize``) as it
  found them, so no test passes or fails because of the tests that ran before it in the same
  process (pytest-xdist's ``--dist loadfile`` groups files differently from run to run).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import settings

from vescale import dispatch
from vescale.random import dtensor as random_dtensor

settings.register_profile("ci", derandomize=True, print_blob=True, database=None)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile("ci")


@contextlib.contextmanager
def _restoring_pytorch():
    implicit = torch._C._get_dtensor_allow_implicit_replication()
    dispatch_installed = dispatch.is_installed()
    random_installed = random_dtensor.is_installed()
    yield
    torch._C._set_dtensor_allow_implicit_replication(implicit)
    if dispatch.is_installed() != dispatch_installed:
        dispatch.install() if dispatch_installed else dispatch.uninstall()
    if random_dtensor.is_installed() != random_installed:
        random_dtensor.install() if random_installed else random_dtensor.uninstall()


# Module scope too: a module-scoped fixture (a model parallelised once for a file's tests) changes
# the state after the first test's snapshot; this restores it when the module ends.
@pytest.fixture(autouse=True, scope="module")
def _module_leaves_pytorch_as_found():
    with _restoring_pytorch():
        yield


@pytest.fixture(autouse=True)
def _test_leaves_pytorch_as_found():
    with _restoring_pytorch():
        yield
