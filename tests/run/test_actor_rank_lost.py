"""A run whose actor rank is killed (a real SIGKILL, mid-run) resumes from its last checkpoint by
itself and ends where an unbroken run ends, the same weights, with process ranks and with Ray
ranks alike; a second loss past cluster.max_actor_restarts fails with the rank named."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fastdraft.config import load_recipe
from fastdraft.run.run import run_recipe
from fastdraft.utils.digest import tensor_digest

pytestmark = pytest.mark.slow
STEPS = 4


def _cfg(char_policy, tmp_path, *extra):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nmodel:\n  path: {char_policy}\nrollout:\n  prompts_per_step: 4\n"
                      "  group_size: 4\n  max_new_tokens: 12\n  max_batch_size: 16\n"
                      "  spec:\n    method: suffix\n"
                      f"algorithm:\n  num_steps: {STEPS}\nactor:\n  num_ranks: 2\n"
                      "  lr: 1.0e-3\ncheckpoint:\n  every: 1\n  keep: 5\n"
                      "logging:\n  wandb:\n    mode: disabled\n  dashboard: false\n"
                      "  progress: false\ndata:\n  task_pool: 4\n")
    return load_recipe(recipe, list(extra))


def _kill_rank1_after_step(run_dir, step: int) -> threading.Thread:
    """SIGKILLs the process of actor rank 1 once metrics.jsonl has `step` rows."""
    import psutil

    def watch() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            metrics = run_dir / "metrics.jsonl"
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= step:
                break
            time.sleep(0.05)
        # A Ray rank: its worker process, under this process's own Ray cluster.
        for proc in psutil.Process().children(recursive=True):
            try:
                cmdline = " ".join(proc.cmdline())
            except psutil.Error:   # ended meanwhile
                continue
            if "_Rank" in cmdline or "HybridWorker" in cmdline:
                proc.send_signal(signal.SIGKILL)
                return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _final_digest(run_dir) -> str:
    """The newest checkpoint's masters (a hybrid run's shards consolidated)."""
    from safetensors.torch import load_file

    from fastdraft.checkpoint.sharded import policy_weights
    ckpt = sorted((run_dir / "checkpoints").iterdir())[-1]
    with policy_weights(ckpt) as policy:
        tensors = load_file(policy / "model.safetensors")
    assert tensors
    return tensor_digest(sorted(tensors.items()))


HYBRID = ["cluster.backend=ray", "cluster.placement=hybrid", "cluster.rollout_workers=2"]


@pytest.mark.parametrize("extra", [   # one Ray cluster at a time: the "ray" group
    ["cluster.backend=local"],
    pytest.param(["cluster.backend=ray"], marks=pytest.mark.xdist_group("ray"), id="ray"),
    # a hybrid worker killed: its actor rank and its engine replica with it
    pytest.param(HYBRID, marks=pytest.mark.xdist_group("ray"), id="hybrid")])
def test_a_killed_actor_rank_resumes_from_the_last_checkpoint(char_policy, tmp_path, extra,
                                                                capsys):
    unbroken = run_recipe(_cfg(char_policy, tmp_path, *extra), tmp_path / "unbroken")
    del unbroken
    run_dir = tmp_path / "broken"
    watcher = _kill_rank1_after_step(run_dir, 2)
    run_recipe(_cfg(char_policy, tmp_path, *extra), run_dir)
    watcher.join(timeout=5)
    out = capsys.readouterr().out
    assert re.search(r"actor rank \d\)? died", out) and "resuming from the last checkpoint" in out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert _final_digest(run_dir) == _final_digest(tmp_path / "unbroken")


@pytest.mark.xdist_group("ray")
def test_a_worker_killed_during_the_checkpoint_write_resumes_from_the_newest_whole_one(
        char_policy, tmp_path, capsys, monkeypatch):
    """Hybrid workers write checkpoint 2 (sharded, worker 0 holds its temp dir): worker 0 is
    SIGKILLed in it, its temp dir half made. The run resumes from checkpoint 1 by itself (the
    half-made one is skipped, then cleared by the next save) and finishes its steps."""
    import ray

    from fastdraft.workers.hybrid_ranks import WorkerRanks
    real, killed = WorkerRanks.save_checkpoint, []

    def save_and_kill(self, root, keep, step, rest):
        if step != 2 or killed:
            return real(self, root, keep, step, rest)
        pid = ray.get(self.workers[0].pid.remote())
        # worker 1 comes to the collective a little late: worker 0 waits in it meanwhile
        self.workers[1].__ray_call__.remote(lambda _: time.sleep(3.0))
        with ThreadPoolExecutor(1) as pool:
            saving = pool.submit(real, self, root, keep, step, rest)
            deadline = time.monotonic() + 60
            while not list(Path(root).glob(".step-000002.tmp-*")):
                assert time.monotonic() < deadline and not saving.done()
                time.sleep(0.002)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return saving.result()

    monkeypatch.setattr(WorkerRanks, "save_checkpoint", save_and_kill)
    run_dir = tmp_path / "run"
    run_recipe(_cfg(char_policy, tmp_path, *HYBRID), run_dir)
    out = capsys.readouterr().out
    assert killed and "hybrid worker 0 (actor rank 0) died" in out
    assert "resuming from the last checkpoint" in out
    assert f"resumed from {run_dir / 'checkpoints' / 'step-000001'}" in out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    checkpoints = run_dir / "checkpoints"
    assert [p.name for p in sorted(checkpoints.iterdir())] == [
        f"step-{s:06d}" for s in range(1, STEPS + 1)]   # no temp dir left, every one whole
    assert _final_digest(run_dir)


def test_ranks_that_keep_dying_end_the_run_with_one_clear_error(char_policy, tmp_path):
    from fastdraft.run.run import ActorRanksLost
    run_dir = tmp_path / "run"
    watcher = _kill_rank1_after_step(run_dir, 1)
    with pytest.raises(ActorRanksLost, match=r"actor rank 1 died.*max_actor_restarts=0.*--resume"):
        run_recipe(_cfg(char_policy, tmp_path, "cluster.max_actor_restarts=0"), run_dir)
    watcher.join(timeout=5)
