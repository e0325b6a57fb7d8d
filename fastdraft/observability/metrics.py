"""Where a run's metrics go, every step: `metrics.jsonl` in the run directory (one JSON object a
step, DESIGN.md's names), wandb (offline unless the user set it up: `logging.wandb.mode`;
observability/wandb_run.py), and one progress line on the terminal."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from fastdraft.config.sections import LoggingConfig
from fastdraft.observability.wandb_run import open_wandb
from fastdraft.utils.atomic import atomic_write_text

METRICS_FILE = "metrics.jsonl"


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a fastdraft run directory?")
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a killed process: ignore it
                continue
    return rows


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg: LoggingConfig, config: dict[str, Any], name: str,
                 total_steps: int, start_step: int = 0) -> None:
        self.path = run_dir / METRICS_FILE
        self.total_steps, self.start_step = total_steps, start_step
        self.show = cfg.progress
        self._started = time.perf_counter()
        kept: list[dict[str, Any]] = []
        if self.path.exists():  # resume: steps after the checkpoint are redone, drop them
            kept = [r for r in read_metrics(run_dir) if r.get("step", 0) < start_step]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = self.path.open("a")
        self.wandb = None
        if cfg.wandb.mode != "disabled":
            self.wandb = open_wandb(run_dir, cfg.wandb, config, name, kept)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if self.show:
            print(self._progress(step, metrics), file=sys.stderr, flush=True)

    def _progress(self, step: int, m: dict[str, float]) -> str:
        done = step + 1 - self.start_step
        elapsed = time.perf_counter() - self._started
        eta = elapsed / done * (self.total_steps - step - 1) if done else math.nan
        share = m.get("timing/rollout_s", 0.0) / max(m.get("timing/step_s", 0.0), 1e-9)
        return (f"step {step + 1}/{self.total_steps}  reward {m.get('reward/mean', 0):.3f}  "
                f"accept {m.get('rollout/accept_length', 1):.2f}  "
                f"step {m.get('timing/step_s', 0):.1f}s (rollout {share:.0%})  ETA {eta:.0f}s")

    def close(self) -> None:
        """The file and the wandb run closed; again (a failure's cleanup after a run's end) it
        does nothing."""
        if self._file.closed:
            return
        self._file.close()
        if self.wandb is not None:
            import wandb
            self.wandb.finish()
            # And wandb's service process ends: its run file is whole when this returns, and a
            # run resumed in this process (a lost actor rank) opens a fresh stream under the
            # same id rather than meeting the old one still flushing (CI once read an offline
            # run file holding no step after such a resume).
            wandb.teardown()


def _plain(value: Any) -> Any:
    return float(value) if hasattr(value, "__float__") and not isinstance(value, bool) else value

