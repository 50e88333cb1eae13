"""``import vescale`` warns when PyTorch is not the release vescale is built and tested on."""

from __future__ import annotations

import torch

from vescale._torch import version_warning


def test_another_pytorch_release_is_named_with_the_fix():
    said = version_warning("2.14.0")
    assert "vescale is built and tested against PyTorch 2.13.*, and this is PyTorch 2.14.0" in said
    assert "torch==2.13.*" in said


def test_the_tested_release_imports_silently():
    assert version_warning(torch.__version__) is None
    assert version_warning("2.13.1+cpu") is None
