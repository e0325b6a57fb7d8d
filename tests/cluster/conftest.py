"""A local Ray cluster of 2 CPUs for a test module's trainer actors."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
