"""The offline wandb run equals metrics.jsonl, step for step, after a kill and a resume: a
SIGKILL can leave wandb's run file with no step in it (what `os._exit` after logging leaves), and
the resumed run replays the steps after its checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fastdraft.observability.metrics import read_metrics
from fastdraft.observability.wandb_run import SUPERSEDED
from fastdraft.run.loop import train
from fastdraft.run.run import Run
from tests.observability.wandb_history import history
from tests.run.test_loop import _cfg


def _offline_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_a_resumed_runs_wandb_history_is_its_metrics_jsonl(char_policy, tmp_path):
    run_dir = tmp_path / "run"
    offline = ["logging.wandb.mode=offline", "checkpoint.every=2", "logging.dashboard=false"]
    train(Run(_cfg(char_policy, *offline, "algorithm.num_steps=3"), run_dir))
    [first] = _offline_runs(run_dir)
    assert [r["_step"] for r in history(first)] == [0, 1, 2]
    # Killed before step 3's checkpoint reached the disk, wandb's file holding no step:
    shutil.rmtree(run_dir / "checkpoints" / "step-000003")
    first.write_bytes(first.read_bytes()[:7])
    resumed = Run(_cfg(char_policy, *offline, "algorithm.num_steps=5"), run_dir, resume=True)
    assert resumed.start_step == 2   # step 2 is replayed
    train(resumed)
    [only] = _offline_runs(run_dir)
    # (within the same second the new offline dir may take the old one's name: it was moved)
    assert (run_dir / "wandb" / SUPERSEDED / first.parent.name / first.name).is_file()
    assert only.name == first.name   # the same run id
    rows, logged = read_metrics(run_dir), history(only)
    assert [r["_step"] for r in logged] == [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    for row, got in zip(rows, logged):
        for key in ("reward/mean", "actor/loss", "rollout/response_len_mean"):
            assert got[key] == pytest.approx(row[key]), (row["step"], key)
