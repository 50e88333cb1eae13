"""Shared fixtures of the dispatch tests: meshes on a fake 4-rank world with vescale's dispatch
installed: ``mesh`` (DP=2, TP=2) and ``unit_mesh`` (DP=1, TP=4: a size-1 dim, TP-only training's
layout). Test modules that need another set-up define their own ``mesh``."""

from __future__ import annotations

import contextlib

import pytest

import vescale
from vescale import dispatch
from vescale.testing import fake_world


@contextlib.contextmanager
def _dispatch_mesh(shape: tuple, names: tuple):
    was_installed = dispatch.is_installed()
    with fake_world(4):
        dispatch.install()
        try:
            yield vescale.init_mesh(shape, names)
        finally:
            if not was_installed:  # leave DTensor as this module found it
                dispatch.uninstall()


@pytest.fixture(scope="module")
def mesh():
    with _dispatch_mesh((2, 2), ("DP", "TP")) as m:
        yield m


@pytest.fixture(scope="module")
def unit_mesh():
    with _dispatch_mesh((1, 4), ("DP", "TP")) as m:
        yield m
