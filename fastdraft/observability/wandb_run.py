"""The run's wandb run: one per run directory (its id kept in RUN_DIR/wandb_id), whose history
equals metrics.jsonl even across kills and resumes.

A resumed run replays the steps after its checkpoint, and a killed process takes with it what
wandb had not yet written (a SIGKILL can leave an offline run file with no step at all). wandb
cannot rewrite steps it already has, so offline (the default) a resumed run starts its wandb run
afresh under the same id: the earlier offline files are moved to wandb/superseded/, and the new
one gets every step metrics.jsonl keeps, then the new ones. `wandb sync RUN_DIR/wandb/offline-
run-*` then uploads one run, step for step metrics.jsonl. Online, wandb resumes the run
(resume="allow") and keeps the steps its server already has (the replayed steps are not sent
again; metrics.jsonl stays the record)."""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path
from typing import Any

from fastdraft.config.sections import WandbConfig
from fastdraft.utils.atomic import atomic_write_text

SUPERSEDED = "superseded"


def open_wandb(run_dir: Path, cfg: WandbConfig, config: dict[str, Any], name: str,
               history: list[dict[str, Any]]) -> Any:
    """A wandb run for run_dir; history: the metrics.jsonl rows a resumed run keeps."""
    import wandb
    os.environ.setdefault("WANDB_SILENT", "true")
    run_id = wandb_id(run_dir)
    if cfg.mode == "offline":
        _supersede_offline_runs(run_dir, run_id)
    run = wandb.init(project=cfg.project, name=name, config=config, dir=str(run_dir),
                     mode=cfg.mode, id=run_id,
                     resume="allow" if cfg.mode == "online" and history else None)
    if cfg.mode == "offline":
        for row in history:
            run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])
    return run


def wandb_id(run_dir: Path) -> str:
    """One wandb run id per run directory (a resumed run continues it)."""
    id_file = run_dir / "wandb_id"
    if not id_file.is_file():
        atomic_write_text(id_file, secrets.token_hex(4))
    return id_file.read_text().strip()


def _supersede_offline_runs(run_dir: Path, run_id: str) -> None:
    runs = run_dir / "wandb"
    for old in sorted(runs.glob(f"offline-run-*-{run_id}")):
        (runs / SUPERSEDED).mkdir(exist_ok=True)
        shutil.move(str(old), runs / SUPERSEDED / old.name)
