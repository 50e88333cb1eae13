"""A (2, 2) DeviceMesh ("DP", "TP") in one process, for lowering tests that need a mesh but no ranks.

The fake process group lets this process act as rank 0 of 4 without any communication. The group
lives for one test module, not the whole session: a default group left in the pytest process would
be inherited by the ranks that ``vescale.testing.run_on_ranks`` forks in other test files (their own
``init_process_group`` would then fail), and other files destroy leftover groups on their own.
"""

import pytest
from torch.distributed.device_mesh import init_device_mesh

from vescale import testing


@pytest.fixture(scope="module")
def fake_world():
    """This process as rank 0 of a fake 4-rank world, torn down after the module."""
    with testing.fake_world(4):
        yield 4


@pytest.fixture(scope="module")
def mesh(fake_world):
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
