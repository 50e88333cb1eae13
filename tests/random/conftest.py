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


NO_COMPILER = "no C compiler on this platform ($CC or cc): the compiled RNG kernel cannot be built here"


@pytest.fixture
def native_kernel():
    """The compiled kernel, built and loaded. Skipped only where the platform has no C compiler (the
    skip reason names it in pytest's summary); a build or load that fails with a compiler present
    fails the test with the compiler's error, so a broken kernel cannot pass CI as a skip."""
    from vescale.random import _native

    if not _native.has_compiler():
        pytest.skip(NO_COMPILER)
    return _native.load(required=True)
