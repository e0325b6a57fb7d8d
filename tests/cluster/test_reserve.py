"""A placement the Ray cluster cannot make is one line within cluster.placement_timeout_s (it
waited forever before), naming what was asked and what the cluster holds."""

from __future__ import annotations

import pytest

from fastdraft.cluster.reserve import reserve
from fastdraft.errors import FastdraftError

pytestmark = pytest.mark.xdist_group("ray")   # one Ray cluster at a time


def test_a_placement_the_cluster_can_make_is_ready_and_one_it_cannot_is_named(local_ray):
    import ray
    from ray.util.placement_group import remove_placement_group
    group = reserve([{"CPU": 1}] * 2, 30.0, "cluster.rollout_workers=2")
    remove_placement_group(group)
    with pytest.raises(FastdraftError) as err:
        reserve([{"CPU": 1, "GPU": 1}] * 8, 0.5, "cluster.rollout_workers=8")
    assert str(err.value).startswith(
        "cluster.rollout_workers=8: Ray could not place 8 bundle(s) of CPU 1, GPU 1 (CPU 8, "
        "GPU 8 in all) within cluster.placement_timeout_s=0.5 s; the cluster holds CPU 2")
    assert "`ray status`" in str(err.value)
    # the refused group is gone: the whole cluster is free again
    assert ray.available_resources().get("CPU") == 2


def test_a_run_whose_placement_cannot_be_made_stops_with_one_line(local_ray, char_policy,
                                                                  tmp_path):
    from fastdraft.config import load_recipe
    from fastdraft.run.run import Run
    cfg = load_recipe(None, [f"model.path={char_policy}", "rollout.spec.method=none",
                             "rollout.max_seq_len=64", "rollout.max_new_tokens=8",
                             "rollout.max_batch_size=8", "logging.wandb.mode=disabled",
                             "cluster.backend=ray", "cluster.rollout_workers=2",
                             "cluster.worker_device=cuda", "cluster.placement_timeout_s=0.5"])
    # no GPU in the cluster: two rollout workers asking for one each are never placed
    with pytest.raises(FastdraftError, match=r"^cluster.rollout_workers=2: Ray could not place 2 "
                       r"bundle\(s\) of CPU 1, GPU 1"):
        Run(cfg, tmp_path / "run")
