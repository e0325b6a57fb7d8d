"""A local Ray cluster whose node address is the loopback one: the hybrid workers' process group
rendezvous at the address Ray gives rank 0's node, and tests connect to loopback only."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def loopback_ray():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    yield
    ray.shutdown()
