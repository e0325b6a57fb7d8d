"""Colocated placement (cluster.placement=colocated): actor rank r runs on rollout worker r's
bundle, the workers give their KV cache back while the actor updates, and the run learns
exactly what the separate placement's run learns (the same completions, the same updates)."""

from __future__ import annotations

import pytest

from fastdraft.cluster.ray_cluster import cuda_name
from fastdraft.config import load_recipe
from fastdraft.run.loop import train_step
from fastdraft.run.run import Run
from tests.run.test_loop import _cfg

RAY = ["cluster.backend=ray", "cluster.rollout_workers=2", "actor.num_ranks=2",
       "rollout.temperature=1.0", "rollout.spec.method=eagle"]


def _steps(policy, drafter, run_dir, placement: str) -> tuple[list, list, list]:
    run = Run(_cfg(policy, *RAY, f"drafter.path={drafter}", f"cluster.placement={placement}",
                   "algorithm.num_steps=2"), run_dir)
    answers, rows, where = [], [], []
    try:
        where = run.actor.ranks.peers.placements()
        for step in range(2):
            rows.append(train_step(run, step))
            answers.append(sorted((c.index, c.token_ids) for part in run.engine.last_parts
                                  for c in part.completions))
        group = run.engine.group.id.hex()
    finally:
        run.finish()
    return answers, rows, [(pg == group, node) for pg, node in where]


@pytest.mark.xdist_group("ray")
def test_colocated_ranks_share_the_workers_bundles_and_learn_as_separate_ones(
        char_policy, char_drafter, tmp_path):
    apart, apart_rows, apart_where = _steps(char_policy, char_drafter, tmp_path / "a",
                                            "separate")
    near, near_rows, near_where = _steps(char_policy, char_drafter, tmp_path / "b",
                                         "colocated")
    assert [in_pool for in_pool, _ in near_where] == [True]     # rank 1 in the pool's group
    assert [in_pool for in_pool, _ in apart_where] == [False]   # a group of its own
    assert near == apart   # the same completions both steps: the update learned the same
    for a, b in zip(apart_rows, near_rows):
        assert a["actor/loss"] == b["actor/loss"] and a["reward/mean"] == b["reward/mean"]
        assert a["cluster/released_mb"] == 0.0
        # the workers' KV caches went back (the exact bytes: tests/engine/test_sleep.py),
        # and came back for the next rollout
        assert b["cluster/released_mb"] > 0
        assert b["rollout/logprob_diff_max"] < 1e-3


def test_colocated_placement_is_checked_in_the_recipe(char_policy):
    with pytest.raises(ValueError, match=r"set cluster\.backend=ray"):
        _cfg(char_policy, "cluster.placement=colocated")
    with pytest.raises(ValueError, match=r"cluster\.rollout_workers >= 2"):
        _cfg(char_policy, "cluster.backend=ray", "cluster.placement=colocated",
             "actor.num_ranks=2")
    with pytest.raises(ValueError, match=r"cluster\.placement must be one of"):
        load_recipe(None, ["cluster.placement=shared"])


def test_a_gpu_as_ray_numbers_it_is_named_as_the_driver_sees_it():
    assert cuda_name("3", "") == "cuda:3"
    assert cuda_name("3", "2,3") == "cuda:1"
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES=0,1"):
        cuda_name("3", "0,1")
