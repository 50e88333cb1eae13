"""The optimiser tests' ``mesh``: DP=2 x TP=2 on a fake 4-rank world with vescale's dispatch installed."""

from __future__ import annotations

import pytest

from vescale.testing import fake_mesh


@pytest.fixture(scope="module")
def mesh():
    with fake_mesh((2, 2), ("DP", "TP")) as m:
        yield m
