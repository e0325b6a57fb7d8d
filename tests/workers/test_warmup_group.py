"""Where the drafter warm-up's members run (workers/warmup_group.py). On GPUs each member gets a
GPU of its own: member 0 (this process) computes on bundle 0's GPU, which Ray hands to no other
member; members 1.. see theirs as cuda:0. On this CPU the GPUs are Ray's logical resources:
what is checked is what Ray reserves and which device each member names; the members' training
on a real GPU is scripts/gpu-check.sh's."""

from __future__ import annotations

import time

import pytest

from fastdraft.cluster.ray_cluster import cuda_name
from fastdraft.workers.warmup_group import WarmupGroup

pytestmark = pytest.mark.xdist_group("ray")


def test_each_gpu_member_gets_a_gpu_of_its_own_and_member_0_names_its_own():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=3, num_gpus=3, include_dashboard=False,
             log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        group = WarmupGroup("cuda", 3)
        try:
            assert ray.available_resources().get("GPU", 0) == 0   # all three reserved
            seen = ray.get([m.__ray_call__.remote(
                lambda self: (self.device, self.rank, str(ray.get_gpu_ids()[0])))
                for m in group.others])
            assert [(device, rank) for device, rank, _ in seen] == [("cuda:0", 1), ("cuda:0", 2)]
            theirs = {cuda_name(gpu) for _, _, gpu in seen}
            assert group.lead.device.startswith("cuda:") and len(theirs) == 2
            assert group.lead.device not in theirs   # member 0's GPU is no member's
        finally:
            group.close()
        deadline = time.monotonic() + 30   # Ray returns the bundles asynchronously
        while ray.available_resources().get("GPU", 0) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray.available_resources().get("GPU", 0) == 3   # released
    finally:
        ray.shutdown()


def test_one_member_is_this_process_on_the_given_device():
    group = WarmupGroup("cuda:3", 1)
    assert group.lead.device == "cuda:3" and group.others == [] and group.group is None
    group.close()
