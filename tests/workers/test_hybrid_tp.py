"""rollout.tensor_parallel=2 over two hybrid workers: one engine replica spans both (each holds
half of every layer, models/tensor_parallel.py), both update the actor (FSDP2) and sync their
slices from its shards. The run rolls out what one process does (step 0's completions token
for token), the gate holds every step, every worker serves its slice of the actor's weights
bit for bit, and the online drafter trained inside the workers reaches both ranks."""

from __future__ import annotations

import pytest
import torch

from fastdraft.errors import FastdraftError
from fastdraft.models.tensor_parallel import TPRank, local_tensor
from fastdraft.run.loop import train_step
from fastdraft.run.run import Run
from tests.run.test_loop import _cfg
from tests.trainer.test_drafter_resilience import ONLINE
from tests.workers.test_hybrid import HYBRID, _engine_weights, _recorded

STEPS = 3
SETTINGS = [*ONLINE, "rollout.temperature=1.0", f"algorithm.num_steps={STEPS}",
            "drafter.online.min_steps_per_step=1"]


@pytest.mark.xdist_group("ray")
def test_a_tensor_parallel_replica_over_two_hybrid_workers(loopback_ray, char_policy,
                                                           char_drafter, tmp_path):
    import ray
    one = Run(_cfg(char_policy, *SETTINGS, f"drafter.path={char_drafter}"), tmp_path / "one")
    run = Run(_cfg(char_policy, *HYBRID, *SETTINGS, f"drafter.path={char_drafter}",
                   "rollout.tensor_parallel=2"), tmp_path / "tp")
    seen_one, seen = _recorded(one), _recorded(run)
    try:
        versions = []
        for step in range(STEPS):
            train_step(one, step)
            row = train_step(run, step)
            assert row["rollout/logprob_diff_max"] < 1e-3   # the gate, fp32 serving
            spans = {s.worker for s in run.engine.last_spans if s.state == "generate"}
            assert spans == {"rollout0", "rollout1"}
            actor = dict(run.actor.full_parameters())
            for k, worker in enumerate(run.engine.workers):   # each its slice, bit for bit
                served = _engine_weights(worker)
                assert all(torch.equal(local_tensor(TPRank(k, 2), n, actor[n]), t)
                           for n, t in served.items())
                assert served["model.layers.0.mlp.up_proj.weight"].shape[0] == (
                    actor["model.layers.0.mlp.up_proj.weight"].shape[0] // 2)
            if step == 0:   # what one process rolls out, token for token
                assert sorted(seen) == sorted(seen_one) and len(seen) == 12
            served_drafters = ray.get([w.__ray_call__.remote(
                lambda self: self.engine.drafter_version) for w in run.engine.workers])
            assert served_drafters == [run.engine.host.drafter_version] * 2
            versions.append(run.engine.host.drafter_version)
        assert versions == sorted(set(versions)) and versions[-1] > 0
    finally:
        one.close_after_failure()
        run.close_after_failure()


@pytest.mark.parametrize("overrides, match", [
    (["cluster.backend=ray", "cluster.placement=hybrid", "cluster.rollout_workers=3",
      "actor.num_ranks=3"], "not whole replicas"),
    ([], "cluster.placement=hybrid"),
    (["cluster.backend=ray", "cluster.placement=hybrid", "cluster.rollout_workers=2",
      "actor.num_ranks=2", "cluster.consolidate_below=2"], "consolidate_below"),
])
def test_settings_a_tensor_parallel_replica_cannot_serve_are_refused(char_policy, overrides,
                                                                     match):
    with pytest.raises(FastdraftError, match=match):
        _cfg(char_policy, "rollout.tensor_parallel=2", *overrides)
