"""Single-device-semantic distributed random numbers (paper section 5, Algorithm 1).

Every random element's value depends only on the generator's (seed, offset), the virtual device
profile and the element's index in the *global* tensor, never on the mesh, the placements or the
rank. So a random DTensor, gathered, is bit-identical to the tensor a single device draws, and the
generator advances identically everywhere, so the next random op matches too.

    vescale.manual_seed(0)                     # every rank, same seed (checked); installs the DTensor hooks
    w = torch.distributed.tensor.randn(1024, 1024, device_mesh=mesh, placements=[Shard(0)])
    torch.nn.init.kaiming_uniform_(w_dtensor)  # any supported op, any placements

    # the single-device reference, same numbers:
    vescale.manual_seed(0)
    with vescale.random.consistent():
        w_ref = torch.randn(1024, 1024)

See docs/random.md for the supported ops, the virtual device profile and checkpointing the state.
"""

from __future__ import annotations

import torch

from vescale.random.consistent import consistent
from vescale.random.dtensor import install, is_installed, uninstall
from vescale.random.checkpointing import checkpoint_context
from vescale.random.generator import device_profile, get_state, set_device_profile, set_state
from vescale.random.kernel import DeviceProfile
from vescale.random import generator as _generator

__all__ = [
    "DeviceProfile",
    "checkpoint_context",
    "consistent",
    "device_profile",
    "get_state",
    "install",
    "is_installed",
    "manual_seed",
    "set_device_profile",
    "set_state",
    "uninstall",
]


def manual_seed(seed: int) -> None:
    """Seed vescale's generator on this rank and route DTensor random ops through it.

    Call it on every rank with the same seed (and in the single-device reference run). When
    torch.distributed is initialised it checks with one all-reduce that all ranks agree on the seed and
    on the device profile, and raises if not. It also seeds PyTorch's own generators with ``seed``, so
    the random ops vescale does not handle (data shuffling, ...) are reproducible as well.
    """
    _generator.manual_seed(seed)
    torch.manual_seed(seed)
    install()
