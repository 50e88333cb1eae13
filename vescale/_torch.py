"""The PyTorch release vescale is built on, checked at import.

vescale extends DTensor through some of its private parts (sharding strategies, the redistribute
planner, the RNG tracker), which change between PyTorch releases: on another release, say so once,
with the fix, before anything else is imported.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["TESTED_TORCH", "version_warning"]

TESTED_TORCH = "2.13"


def version_warning(version: str) -> str | None:
    """What ``import vescale`` says on PyTorch ``version``: None on the tested release."""
    if version.startswith(TESTED_TORCH + "."):
        return None
    return (
        f"vescale is built and tested against PyTorch {TESTED_TORCH}.*, and this is PyTorch {version}: DTensor "
        f"internals that vescale extends may differ. Install torch=={TESTED_TORCH}.* (pip install "
        f"'torch=={TESTED_TORCH}.*'), or run the test suite (bash scripts/test.sh) against this version first."
    )


_said = version_warning(torch.__version__)
if _said:
    warnings.warn(_said, stacklevel=2)
