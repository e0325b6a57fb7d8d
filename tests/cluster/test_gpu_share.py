"""cluster.gpus_per_worker: rollout workers that share a GPU (0.5: two engines on one GPU). On
this CPU the GPU is Ray's logical resource: what is checked is what Ray reserves and where
the workers land (both on GPU 0, as cuda:0); the engines on a real GPU run in
scripts/gpu-check.sh (GPU_CHECK_RL=1)."""

from __future__ import annotations

import pytest

from fastdraft.cluster.ray_cluster import cuda_name
from fastdraft.cluster.reserve import TRAINER_GPU_SHARE, worker_bundle
from fastdraft.config.sections import ClusterConfig
from tests.run.test_loop import _cfg


def test_a_worker_bundle_reserves_its_share_of_a_gpu_on_cuda_only():
    half = ClusterConfig(backend="ray", rollout_workers=2, gpus_per_worker=0.5, worker_threads=2)
    assert worker_bundle(half, "cuda") == {"CPU": 2, "GPU": 0.5}
    assert worker_bundle(half, "cpu") == {"CPU": 2}
    assert worker_bundle(ClusterConfig(backend="ray"), "cuda:1") == {"CPU": 1, "GPU": 1.0}


def test_gpu_sharing_is_checked_in_the_recipe(char_policy):
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        ClusterConfig(backend="ray", gpus_per_worker=2)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        ClusterConfig(backend="ray", gpus_per_worker=0)
    with pytest.raises(ValueError, match=r"set cluster\.backend=ray"):
        ClusterConfig(gpus_per_worker=0.5)
    with pytest.raises(ValueError, match=r"set model\.device=cuda"):
        _cfg(char_policy, "cluster.backend=ray", "cluster.rollout_workers=2",
             "cluster.gpus_per_worker=0.5")
    cfg = _cfg(char_policy, "cluster.backend=ray", "cluster.rollout_workers=2",
               "cluster.gpus_per_worker=0.5", "cluster.worker_device=cuda")
    assert cfg.cluster.gpus_per_worker == 0.5


@pytest.mark.xdist_group("ray")
def test_two_half_gpu_workers_and_their_trainer_land_on_one_gpu():
    ray = pytest.importorskip("ray")
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False,
             log_to_driver=False)
    try:
        def gpus_seen(bundles: list[dict], share: float) -> list[str] | None:
            group = placement_group(bundles, strategy="PACK")
            try:
                ray.get(group.ready(), timeout=20)
            except ray.exceptions.GetTimeoutError:
                return None   # Ray cannot place it on this cluster's one GPU
            try:
                @ray.remote(num_cpus=0)
                def device() -> str:
                    return cuda_name(str(ray.get_gpu_ids()[0]))
                return ray.get([device.options(
                    num_gpus=bundle["GPU"] * share,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        group, placement_group_bundle_index=i)).remote()
                    for i, bundle in enumerate(bundles)])
            finally:
                remove_placement_group(group)

        half = ClusterConfig(backend="ray", rollout_workers=2, gpus_per_worker=0.5)
        whole = ClusterConfig(backend="ray", rollout_workers=2)
        # the worker (its share) and its trainer (the rest) on each half: all on GPU 0
        assert gpus_seen([worker_bundle(half, "cuda")] * 2, 1 - TRAINER_GPU_SHARE) == \
            ["cuda:0", "cuda:0"]
        assert gpus_seen([worker_bundle(half, "cuda")] * 2, TRAINER_GPU_SHARE) == \
            ["cuda:0", "cuda:0"]
        assert gpus_seen([worker_bundle(whole, "cuda")] * 2, 1.0) is None   # two GPUs asked
    finally:
        ray.shutdown()
