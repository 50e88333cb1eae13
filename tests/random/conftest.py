"""Fixtures shared by the vescale.random tests."""

import pytest

import vescale.random as vr
from vescale.random import dtensor as vr_dtensor, generator as vr_generator


@pytest.fixture
def fresh_rng():
    """Seeded, installed vescale RNG for one test; afterwards the previous state is back and DTensor's
    own RNG handling restored, so other test files see PyTorch's defaults."""
    saved = (vr_generator._state.seed, vr_generator._state.offset, vr_generator._state.profile)
    was_installed = vr_dtensor.is_installed()
    vr.manual_seed(1234)
    yield
    vr_generator._state.seed, vr_generator._state.offset, vr_generator._state.profile = saved
    if not was_installed:
        vr.uninstall()
