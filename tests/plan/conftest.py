"""A (2, 2) DeviceMesh ("DP", "TP") in one process, for lowering tests that need a mesh but no ranks.

The fake process group lets this process act as rank 0 of 4 without any communication. The group
lives for one test module, not the whole session: a default group left in the pytest process would
be inherited by the ranks that ``vescale.testing.run_on_ranks`` forks in other test files (their own
``init_process_group`` would then fail), and other files destroy leftover groups on their own.
"""

import pytest
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
from torch.distributed.device_mesh import init_device_mesh


@pytest.fixture(scope="module")
def fake_world():
    """This process as rank 0 of a fake 4-rank world, torn down after the module."""
    if dist.is_initialized():
        dist.destroy_process_group()  # left over by a test elsewhere in this process
    dist.init_process_group("fake", rank=0, world_size=4)
    try:
        yield 4
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def mesh(fake_world):
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
