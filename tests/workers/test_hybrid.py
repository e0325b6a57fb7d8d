"""Hybrid workers (cluster.placement=hybrid): every worker holds an actor rank beside its engine
replica, rolls out every step, updates (SPMD) and loads its engine from the shards itself; the
run learns what one process learns (step 0's completions token for token, its loss within fp32
tolerance)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from fastdraft.checkpoint.sharded import is_sharded, policy_weights
from fastdraft.run.loop import train_step
from fastdraft.run.run import Run
from fastdraft.workers.hybrid import HEAD
from tests.run.test_loop import _cfg

HYBRID = ["cluster.backend=ray", "cluster.placement=hybrid", "cluster.rollout_workers=2",
          "actor.num_ranks=2", "rollout.temperature=1.0", "rollout.spec.method=eagle",
          "algorithm.num_steps=2"]


def _recorded(run: Run) -> list:
    """Every completion the run's rollouts finish, as (index, token ids), in order of arrival."""
    seen: list = []
    run.on_finish_hooks.append(lambda c: seen.append((c.index, c.token_ids)))
    return seen


def _named_tensors(value) -> bool:
    """A (name, tensor) list: weights, a policy's or a drafter's."""
    return isinstance(value, list) and any(
        isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)
        and isinstance(x[1], torch.Tensor) for x in value)


def _policy_names(value) -> bool:
    """A (name, tensor) list of the policy's weights (what a put of the weights would be)."""
    return isinstance(value, list) and any(
        isinstance(x, tuple) and isinstance(x[0], str)
        and (x[0].startswith("model.") or x[0] == "lm_head.weight") for x in value)


def _engine_weights(worker) -> dict[str, torch.Tensor]:
    import ray
    return ray.get(worker.__ray_call__.remote(
        lambda self: {n: p.detach().clone() for n, p in self.engine.model.named_parameters()}))


@pytest.mark.xdist_group("ray")
def test_hybrid_workers_roll_out_update_and_sync_on_their_devices(
        loopback_ray, char_policy, char_drafter, tmp_path, monkeypatch):
    import ray
    one = Run(_cfg(char_policy, "rollout.temperature=1.0", "rollout.spec.method=eagle",
                   f"drafter.path={char_drafter}", "algorithm.num_steps=2"), tmp_path / "one")
    run = Run(_cfg(char_policy, *HYBRID, f"drafter.path={char_drafter}"), tmp_path / "two")
    puts, real_put = [], ray.put

    def put(value, *args, **kwargs):
        puts.append(value)
        return real_put(value, *args, **kwargs)

    monkeypatch.setattr(ray, "put", put)
    seen_one, seen = _recorded(one), _recorded(run)
    try:
        one_rows, rows = [], []
        for step in range(2):
            one_rows.append(train_step(one, step))
            rows.append(train_step(run, step))
            spans = run.engine.last_spans
            # both workers rolled out this step, and both updated
            assert {s.worker for s in spans if s.state == "generate"} == {"rollout0", "rollout1"}
            assert rows[-1]["cluster/rollout0/generate_s"] > 0
            assert rows[-1]["cluster/rollout1/generate_s"] > 0
            assert rows[-1]["timing/push_s"] > 0 and rows[-1]["rollout/logprob_diff_max"] < 1e-3
            # every worker's engine holds the actor's new weights, bit for bit (fp32 serving),
            # loaded on its own device from the gathered shards
            actor = dict(run.actor.full_parameters())
            for k, worker in enumerate(run.engine.workers):
                assert all(torch.equal(actor[n], t) for n, t in _engine_weights(worker).items())
                sync = run.engine.last_syncs[k]
                assert sync.devices == ("cpu",)
                assert sync.nbytes == sum(t.numel() * 4 for t in actor.values())
            if step == 0:   # the same completions as one process, and the same loss
                assert sorted(seen) == sorted(seen_one) and len(seen) == 12
                assert rows[0]["actor/loss"] == pytest.approx(one_rows[0]["actor/loss"],
                                                              abs=1e-5)
        # the driver's replica keeps the policy's head only: the workers hold the policy
        host = dict(run.engine.host.model.named_parameters())
        assert all(t.numel() == 0 for n, t in host.items() if n not in HEAD)
        assert all(torch.equal(host[n], actor[n]) for n in HEAD if n in host)
        # no policy weights went through the object store (the drafter's went, as published)
        assert not any(_policy_names(v) for v in puts)
        assert run.engine._weights is None
        # worker 0 writes the checkpoint: no weight comes to this process for it
        monkeypatch.setattr(run.actor.ranks, "full_state", None)
        run.save_checkpoint(2)
        latest = run.checkpoints.latest(digests=True)   # waits for worker 0's write
        assert latest.name == "step-000002"
        saved = run.checkpoints.load(latest)
        assert saved.step == 2 and saved.sharded   # each worker wrote its shard
        with policy_weights(latest) as policy:   # the shards put together are the masters
            masters = load_file(str(policy / "model.safetensors"))
        assert all(torch.equal(masters[n], t) for n, t in actor.items())
    finally:
        one.close_after_failure()
        run.close_after_failure()


@pytest.mark.xdist_group("ray")
def test_a_run_resumes_with_another_layout_and_number_of_workers(loopback_ray, char_policy,
                                                                tmp_path):
    """One process -> 2 hybrid workers -> one process: each resume starts from the checkpoint's
    weights (the engines serve them: its policy version) and continues the step count. The
    hybrid workers' checkpoint is sharded (a file per worker) and one process reads it."""
    from fastdraft.run.loop import train
    run_dir = tmp_path / "run"
    hybrid = ["cluster.backend=ray", "cluster.placement=hybrid", "cluster.rollout_workers=2",
              "actor.num_ranks=2"]
    for steps, layout, resume in ((1, [], False), (2, hybrid, True), (3, [], True)):
        run = Run(_cfg(char_policy, f"algorithm.num_steps={steps}", "logging.dashboard=false",
                       *layout), run_dir, resume=resume)
        try:
            assert run.start_step == steps - 1 and run.engine.policy_version == steps - 1
            if run.hybrid:   # every replica serves the checkpoint's masters
                with policy_weights(run.checkpoints.latest()) as policy:
                    saved = load_file(str(policy / "model.safetensors"))
                for worker in run.engine.workers:
                    served = _engine_weights(worker)
                    assert all(torch.equal(served[n], t) for n, t in saved.items())
            train(run)
            latest = run.checkpoints.latest()
            assert is_sharded(latest) == run.hybrid
            if run.hybrid:   # each worker wrote its own shard, nothing else holds the weights
                assert sorted(p.name for p in (latest / "actor").glob("*.distcp")) == [
                    "__0_0.distcp", "__1_0.distcp"]
                assert not list((latest / "model").glob("*.safetensors"))
        finally:
            run.close_after_failure()
    assert run.checkpoints.latest().name == "step-000003"


@pytest.mark.xdist_group("ray")
@pytest.mark.parametrize("training", ["one", "data_parallel"])
def test_the_online_drafter_trains_inside_the_hybrid_workers(loopback_ray, char_policy,
                                                             char_drafter, tmp_path, training,
                                                             monkeypatch):
    """The drafter's trainer is a member inside a hybrid worker (one: the last worker's;
    data_parallel: every worker's), in the worker's own process: no process of its own. It
    trains in the tail and the update, and every step serves a newer drafter, broadcast to
    every worker's engine from the member's worker over the workers' process group (nothing
    through the object store). At the end the drafter is exported against the policy of the
    workers' sharded checkpoint."""
    import ray

    from fastdraft.drafter.checkpoint import trainable_named_tensors
    from fastdraft.observability.metrics import read_metrics
    from fastdraft.workers.trainer_group import TrainerGroup
    from tests.trainer.test_drafter_resilience import ONLINE
    run = Run(_cfg(char_policy, *HYBRID, *ONLINE, f"drafter.path={char_drafter}",
                   f"cluster.drafter_training={training}", "algorithm.num_steps=3",
                   "drafter.export=true",
                   "rollout.prompts_per_step=3", "rollout.max_new_tokens=64",
                   "rollout.max_batch_size=4", "drafter.online.min_steps_per_step=1"),
              tmp_path / "run")
    try:
        workers = ray.get([w.pid.remote() for w in run.engine.workers])
        trainer = run.drafter.worker
        members = trainer.members if isinstance(trainer, TrainerGroup) else [trainer]
        assert [m.pid for m in members] == (workers if training == "data_parallel"
                                            else workers[-1:])
        puts, real_put = [], ray.put
        monkeypatch.setattr(ray, "put", lambda v, *a, **k: puts.append(v) or real_put(v, *a, **k))
        for step in range(3):
            train_step(run, step)
        assert not any(_named_tensors(v) for v in puts)   # no drafter (or policy) tensor put
        host = run.engine.host
        for worker in run.engine.workers:   # every engine serves the driver's drafter
            version, served = ray.get(worker.__ray_call__.remote(lambda self: (
                self.engine.drafter_version,
                dict(trainable_named_tensors(self.engine.model_drafter)))))
            assert version == host.drafter_version
            assert all(torch.equal(served[n], t)
                       for n, t in trainable_named_tensors(host.model_drafter))
        run.finish()   # the export (what train does at the end)
    finally:
        run.close_after_failure()
    rows = read_metrics(tmp_path / "run")
    versions = [r["drafter/version"] for r in rows]
    assert versions == sorted(set(versions)) and versions[-1] > 0
    assert sum(r["drafter/train_tokens_on_idle"] for r in rows) > 0
    exported = [p for p in (tmp_path / "run" / "export").iterdir() if p.is_dir()]
    assert exported and all(any(p.glob("*.safetensors")) for p in exported)
