"""Shared fixture of the dispatch tests: a (DP=2, TP=2) mesh on a fake 4-rank world, vescale's
dispatch installed (test modules that need another set-up define their own ``mesh``)."""

from __future__ import annotations

import pytest

import vescale
from vescale import dispatch
from vescale.testing import fake_world


@pytest.fixture(scope="module")
def mesh():
    with fake_world(4):
        dispatch.install()
        try:
            yield vescale.init_mesh((2, 2), ("DP", "TP"))
        finally:
            dispatch.install()
