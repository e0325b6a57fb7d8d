"""What each worker did during each RL step, as spans of states: a rollout worker generates, sits
idle or trains the drafter on that idle time, the actor updates, a worker receives weights. The
step's wall-clock time alone cannot say whether a slow step was one straggling replica or idle
replicas waiting for the actor, and whether the drafter used the idle time; these spans can.
They go to RUN_DIR/cluster_timeline.jsonl (one JSON line a step, beside metrics.jsonl, and
truncated with it on resume) for the dashboard's Gantt panel, and `spans_metrics` sums them into
per-step scalars for metrics.jsonl. Pure Python (no torch, no ray): the coordinator, the cluster
simulator and the dashboard all read and write it."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fastdraft.errors import FastdraftError
from fastdraft.utils.atomic import atomic_write_text

STATES = ("generate", "idle", "train", "update", "push")
TIMELINE_FILE = "cluster_timeline.jsonl"
# The states that count as a rollout worker not generating: training the drafter is how the idle
# time gets used, but the replica is still not producing rollouts.
_UNUSED_STATES = ("idle", "train")


@dataclass(frozen=True)
class Span:
    """One worker in one state from `start_s` to `end_s`, seconds since the step started."""
    worker: str   # e.g. "rollout0", "rollout1", "actor"
    state: str    # one of STATES
    start_s: float
    end_s: float

    def __post_init__(self) -> None:
        # Checked here, not when drawn: a bad span found at plot time, steps later, no longer
        # points at the code that recorded it.
        if not isinstance(self.worker, str) or not self.worker:
            raise FastdraftError(f"span worker must be a non-empty name, got {self.worker!r}")
        if self.state not in STATES:
            raise FastdraftError(f"span state {self.state!r} of {self.worker} is not one of "
                                 f"{STATES}")
        if not (math.isfinite(self.start_s) and self.start_s >= 0):
            raise FastdraftError(f"span start_s {self.start_s!r} of {self.worker} must be finite "
                                 "and >= 0 (seconds since the step started)")
        if not (math.isfinite(self.end_s) and self.end_s >= self.start_s):
            raise FastdraftError(f"span end_s {self.end_s!r} of {self.worker} must be finite and "
                                 f">= start_s {self.start_s!r}")

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def is_rollout_worker(worker: str) -> bool:
    return worker.startswith("rollout")


def spans_metrics(spans: list[Span], workers: list[str]) -> dict[str, float]:
    """Per worker in `workers`: seconds generating, idle and training the drafter
    (`cluster/{w}/generate_s`, `/idle_s`, `/train_s`; 0.0 for a state it was never in), and
    `cluster/idle_fraction`: the share of the rollout workers' time (their count times the
    rollout span, first start to last end over their spans) spent idle or training, i.e. not
    generating; 0.0 without rollout spans. A rollout worker that recorded spans counts even if
    `workers` leaves it out: it existed, and its idle time is real."""
    out: dict[str, float] = {}
    for w in workers:
        for state in ("generate", "idle", "train"):
            out[f"cluster/{w}/{state}_s"] = sum(s.duration_s for s in spans
                                               if s.worker == w and s.state == state)
    rollout_spans = [s for s in spans if is_rollout_worker(s.worker)]
    rollout_workers = {w for w in workers if is_rollout_worker(w)}
    rollout_workers |= {s.worker for s in rollout_spans}
    window = (max(s.end_s for s in rollout_spans) - min(s.start_s for s in rollout_spans)
              if rollout_spans else 0.0)
    unused = sum(s.duration_s for s in rollout_spans if s.state in _UNUSED_STATES)
    # An empty (zero-length) window has no time to be idle in: 0.0, not a division by zero.
    out["cluster/idle_fraction"] = (unused / (len(rollout_workers) * window)
                                    if window > 0 else 0.0)
    return out


class TimelineLog:
    """Appends one line a step to RUN_DIR/cluster_timeline.jsonl, flushed so a dashboard redrawn
    mid-run (or a killed run's) sees every finished step."""

    def __init__(self, run_dir: Path, start_step: int = 0) -> None:
        self.path = Path(run_dir) / TIMELINE_FILE
        if self.path.exists():
            # Resume: the steps from the checkpoint on are redone, so their old lines go, as in
            # metrics.jsonl (a fresh start, step 0, drops them all). Rewriting also drops a line
            # a killed run cut short, which the next append would otherwise be glued onto.
            kept = [row for row in _read_rows(self.path) if row["step"] < start_step]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, step: int, spans: list[Span]) -> None:
        row = {"step": int(step), "spans": [asdict(s) for s in spans]}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TimelineLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_timeline(run_dir: str | Path) -> dict[int, list[Span]]:
    """Step -> its spans, in step order; {} without the file (a run with no cluster). A later line
    for the same step wins (a step redone after a resume whose log was not truncated)."""
    path = Path(run_dir) / TIMELINE_FILE
    if not path.is_file():
        return {}
    timeline = {row["step"]: [Span(**s) for s in row["spans"]] for row in _read_rows(path)}
    return dict(sorted(timeline.items()))


def _read_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:   # a line cut by a killed process: that step is lost
            continue
        rows.append(row)
    return rows
