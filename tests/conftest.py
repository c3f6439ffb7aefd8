"""Session fixtures: the local worker pools that run `@spmd` test bodies (see spmd.py)."""

import math

import pytest
import torch

from spmd import Simulated, WorkerPools

torch.set_num_threads(1)

_world_sizes: set[int] = set()


def pytest_collection_modifyitems(items):
    """Note which world sizes the selected spmd tests need, so their pools start together."""
    for item in items:
        if getattr(getattr(item, "function", None), "spmd_meshes", None) and hasattr(item, "callspec"):
            if not isinstance(item.callspec.params["mesh"], Simulated):  # simulated ranks need no pool
                _world_sizes.add(math.prod(item.callspec.params["mesh"]))


@pytest.fixture(scope="session")
def spmd_pools():
    pools = WorkerPools(_world_sizes)
    yield pools
    pools.close()
