"""Shared fixtures of the dispatch tests: meshes on a fake 4-rank world with vescale's dispatch
installed: ``mesh`` (DP=2, TP=2) and ``unit_mesh`` (DP=1, TP=4: a size-1 dim, TP-only training's
layout). Test modules that need another set-up define their own ``mesh``."""

from __future__ import annotations

import pytest

from vescale.testing import fake_mesh


@pytest.fixture(scope="module")
def mesh():
    with fake_mesh((2, 2), ("DP", "TP")) as m:
        yield m


@pytest.fixture(scope="module")
def unit_mesh():
    with fake_mesh((1, 4), ("DP", "TP")) as m:
        yield m
