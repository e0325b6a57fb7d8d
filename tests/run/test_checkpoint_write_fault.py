"""A checkpoint write that fails mid-run, on the CLI in real processes (the fault injected by
tests/run/checkpoint_fault_cli.py): the run ends at the first step boundary that sees the
failure, not at a later save, as a normal end does (the drafter saved and exported, the metrics
closed) when the run directory still takes files, and says so in a line when it does not; one
line names the checkpoint, the OS error and the resume command, exit 2; the checkpoint before is
whole and resumes. Slow: each case starts a run."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fastdraft.checkpoint.layout import step_dirs, validate
from tests.run.test_stop_signals import CLI, RECIPE

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
FAULT_CLI = [sys.executable, "-m", "tests.run.checkpoint_fault_cli"]


def _overrides(policy_and_drafter, steps: int, every: int) -> list[str]:
    policy, drafter = policy_and_drafter
    # A fixed drafter: the run's end saves and exports it (what a failed write must not lose).
    return [f"model.path={policy}", f"drafter.path={drafter}", "drafter.online.enabled=false",
            "data.task_options.max_terms=5", "rollout.prompts_per_step=4",
            "rollout.group_size=4", "rollout.max_new_tokens=40", "rollout.max_batch_size=16",
            f"algorithm.num_steps={steps}", f"checkpoint.every={every}", "checkpoint.keep=10",
            "logging.wandb.mode=disabled", "logging.dashboard=false", "logging.progress=false"]


def _run_with_fault(fault: str, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([*FAULT_CLI, "run", str(RECIPE), *args], capture_output=True,
                          text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "FASTDRAFT_TEST_CKPT_FAULT": fault})


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"]
            for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _the_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = [x for x in done.stderr.splitlines() if x.startswith("fastdraft run: error:")]
    assert len(lines) == 1, done.stderr
    assert done.stderr.rstrip().endswith(lines[0]), done.stderr   # the last word
    return lines[0]


def _checkpoints(run_dir: Path) -> list[int]:
    found = step_dirs(run_dir / "checkpoints")
    for step, path in found:
        assert validate(path, digests=True) == step   # whatever is there is whole
    return [step for step, _ in found]


def _exported(run_dir: Path) -> bool:
    return ((run_dir / "drafter" / "drafter_config.json").is_file()
            and (run_dir / "export").is_dir())


@pytest.mark.parametrize("scope", ["checkpoints", "run"])
def test_an_unwritable_checkpoint_dir_ends_the_run_at_that_step_and_it_resumes(
        policy_and_drafter, tmp_path, scope):
    """RUN/checkpoints (or all of RUN) takes no new entry after step 1's checkpoint: step 2's
    save fails at once (its temp dir is made at the save), so the run ends after step 2, the
    step whose checkpoint failed; nothing of a step 3 is run."""
    run_dir = tmp_path / "run"
    args = [*_overrides(policy_and_drafter, steps=4, every=1), "--run-dir", str(run_dir)]
    done = _run_with_fault(f"unwritable:{scope}", args)
    line = _the_error_line(done)
    assert f"checkpoint {run_dir}/checkpoints/step-000002 not written: Permission denied: " \
           f"{run_dir}/checkpoints/.step-000002.tmp-" in line, line
    assert f"(under --run-dir {run_dir})" in line and line.endswith("--resume"), line
    assert _steps(run_dir) == [0, 1]   # metrics closed with the failing step's row
    assert _checkpoints(run_dir) == [1]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    warned = [x for x in done.stderr.splitlines() if "was not written after the failed" in x]
    if scope == "checkpoints":   # the run dir takes files: the run's end as a normal one
        assert _exported(run_dir) and not warned, done.stderr
        assert "DRAFTER EXPORTED" in done.stdout
    else:   # it does not: said in one line, naming the file
        assert not (run_dir / "drafter").exists()
        assert len(warned) == 1 and "Permission denied: " in warned[0], done.stderr
        return

    command = shlex.split(line.split("resume with: ")[1])
    resumed = subprocess.run([*CLI, *command[1:]], capture_output=True, text=True,
                             timeout=600, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {run_dir}/checkpoints/step-000001 (step 1)" in resumed.stdout
    assert _steps(run_dir) == [0, 1, 2, 3]
    assert _checkpoints(run_dir) == [1, 2, 3, 4]


@pytest.mark.parametrize("steps, every, fail", [(6, 2, 4), (2, 1, 2)],
                         ids=["beside-the-next-step", "the-last-one"])
def test_a_background_write_that_fails_ends_the_run_at_the_next_boundary(
        policy_and_drafter, tmp_path, steps, every, fail):
    """Checkpoint `fail`'s write fails while the step after it runs (beside-the-next-step:
    every=2, so no save at that step's end would meet it; the boundary's poll does), or it is
    the last one (the-last-one: the run's end meets it): the run ends there, the steps up to
    that boundary logged (the one under way while the write ran among them), nothing after;
    drafter saved and exported from the checkpoint before."""
    run_dir = tmp_path / "run"
    args = [*_overrides(policy_and_drafter, steps=steps, every=every), "--run-dir", str(run_dir)]
    done = _run_with_fault(f"write:{fail}", args)
    line = _the_error_line(done)
    name = f"step-{fail:06d}"
    assert f"checkpoint {run_dir}/checkpoints/{name} not written: No space left on device: " \
           f"{run_dir}/checkpoints/.{name}.tmp-" in line, line
    assert line.endswith("--resume"), line
    last_logged = min(fail, steps - 1)   # the step under way when the write failed
    assert _steps(run_dir) == list(range(last_logged + 1))
    assert _checkpoints(run_dir) == list(range(every, fail, every))
    assert _exported(run_dir), done.stderr


HYBRID = ["cluster.backend=ray", "cluster.placement=hybrid", "cluster.rollout_workers=2"]


@pytest.mark.xdist_group("ray")
@pytest.mark.parametrize("fault", ["background-write", "temp-dir"])
def test_a_hybrid_workers_failed_write_ends_the_run_and_is_no_lost_rank(char_policy, tmp_path,
                                                                        capsys, monkeypatch,
                                                                        fault):
    """Hybrid workers write the checkpoints (worker 0 publishes them in the background).
    background-write: worker 0's write of checkpoint 2 fails (ENOSPC) and has ended by step 2's
    boundary, where the driver's poll of worker 0 sees it. temp-dir: checkpoints/ takes no new
    directory (EACCES) when worker 0 makes checkpoint 2's, before the collective its peer waits
    in. Either way the run ends after step 2 with the CheckpointWriteError (its OS error as the
    cause: the CLI's one line), not as a lost actor rank resumed by itself, and nothing hangs."""
    import ray

    from fastdraft.checkpoint import CheckpointWriteError
    from fastdraft.run.run import run_recipe
    from fastdraft.workers.hybrid_ranks import WorkerRanks
    from tests.run.test_actor_rank_lost import _cfg

    def in_worker_0(worker):   # runs in worker 0's process (Ray pickles it by value)
        import errno as errno_
        import re as re_

        import fastdraft.checkpoint.manager as manager_mod
        import fastdraft.checkpoint.write as write_mod
        real, real_temp_dir = write_mod.save_tensors, manager_mod.temp_dir_for

        def save_tensors(tensors, path, *args, **kwargs):
            if re_.search(r"\.step-000002\.tmp", str(path)):
                raise OSError(errno_.ENOSPC, "No space left on device", str(path))
            return real(tensors, path, *args, **kwargs)

        def temp_dir_for(final):
            if final.name == "step-000002":
                raise PermissionError(errno_.EACCES, "Permission denied",
                                      str(final.parent / ".step-000002.tmp-x"))
            return real_temp_dir(final)
        if fault == "temp-dir":
            manager_mod.temp_dir_for = temp_dir_for
        else:
            write_mod.save_tensors = save_tensors

    def written(worker):   # worker 0's background write of the step just saved has ended
        import concurrent.futures
        if worker.checkpoints is not None and worker.checkpoints._pending is not None:
            concurrent.futures.wait([worker.checkpoints._pending[1]], timeout=120)

    real_save = WorkerRanks.save_checkpoint

    def save_checkpoint(self, root, keep, step, rest):
        if step == 1:
            ray.get(self.workers[0].__ray_call__.remote(in_worker_0))
        out = real_save(self, root, keep, step, rest)
        if step == 2:
            ray.get(self.workers[0].__ray_call__.remote(written))
        return out

    monkeypatch.setattr(WorkerRanks, "save_checkpoint", save_checkpoint)
    run_dir = tmp_path / "run"
    with pytest.raises(CheckpointWriteError, match="step-000002 not written") as failed:
        run_recipe(_cfg(char_policy, tmp_path, *HYBRID), run_dir)
    assert isinstance(failed.value.__cause__, OSError) and failed.value.__cause__.filename
    assert failed.value.__cause__.errno == (13 if fault == "temp-dir" else 28)
    assert "resuming" not in capsys.readouterr().out
    assert _steps(run_dir) == [0, 1]
    assert _checkpoints(run_dir) == [1]
