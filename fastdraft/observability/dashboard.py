"""The run's dashboard: one PNG with reward, rollout time and its tail share, accept length and
acceptance by draft depth, and rollout tokens per second, per step (read from metrics.jsonl, so
`fastdraft plot RUN_DIR` redraws it for any run, finished or not); with online drafter training,
the drafter's top-1 agreement with the policy too. A reference run of the same recipe without
speculation (`fastdraft bench recipe` writes one to OUT/off) adds its rollout time and tokens
per second as dashed lines: the speedup is the gap between them. A run on a cluster of rollout
workers (cluster_timeline.jsonl beside metrics.jsonl) adds a Gantt of what each worker did in
the last steps: a straggling replica or replicas idling while the actor updates show there, not
in the per-step averages above."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fastdraft.errors import FastdraftError
from fastdraft.observability.metrics import read_metrics
from fastdraft.observability.timeline import STATES, Span, is_rollout_worker, read_timeline
from fastdraft.utils.outputs import png_stamp

DASHBOARD_FILE = "dashboard.png"
Rows = list[dict[str, Any]]
GANTT_STEPS = 4   # the last steps the Gantt shows: more and one step's spans get too thin to read
STATE_COLORS = {"generate": "tab:blue", "idle": "lightgrey", "train": "tab:green",
                "update": "tab:orange", "push": "tab:purple"}


def draw_dashboard(run_dir: str | Path, out: str | Path | None = None,
                   reference: str | Path | None = None) -> Path:
    """Saves the dashboard (default RUN_DIR/dashboard.png); reference: a plain-decoding run."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise FastdraftError(f"{run_dir} has no logged steps yet")
    reference_rows = None
    if reference is not None:
        reference = Path(reference)
        reference_rows = read_metrics(reference)
        if not reference_rows:
            raise FastdraftError(f"the reference {reference} has no logged steps yet")
        # Its lines are labelled "plain decoding": a speculating run there would lie.
        if any("rollout/accept_length" in r for r in reference_rows):
            raise FastdraftError(f"the reference {reference} speculates: give a run of the same "
                                 "recipe without speculation (e.g. `fastdraft bench recipe`'s "
                                 "OUT/off)")
    fig = dashboard_figure(rows, reference_rows,
                           reference_name=reference.name if reference else "",
                           title=str(run_dir), timeline=read_timeline(run_dir) or None)
    out = Path(out) if out is not None else run_dir / DASHBOARD_FILE
    # Written aside and renamed: a viewer refreshing the PNG mid-run never reads half of it.
    fd, tmp = tempfile.mkstemp(suffix=".png", dir=out.parent)
    os.close(fd)
    fig.savefig(tmp, dpi=90, metadata=png_stamp("dashboard"))   # a later plot may replace it
    os.replace(tmp, out)
    return out


def dashboard_figure(rows: Rows, reference_rows: Rows | None = None, reference_name: str = "",
                     title: str = "", timeline: dict[int, list[Span]] | None = None) -> Figure:
    """The dashboard of `rows` (metrics.jsonl's lines), `reference_rows` dashed beside it, and
    with a `timeline` (cluster_timeline.jsonl's steps) a Gantt of its last steps below.
    A bare Figure, not pyplot: no global backend or figure registry to set up or leak."""
    if not timeline:
        fig = Figure(figsize=(12, 7.5))
        (reward_ax, time_ax), (accept_ax, speed_ax) = fig.subplots(2, 2)
    else:
        # The figure grows by the Gantt's height, so the 2x2 grid keeps its size.
        gantt_h = _gantt_height(timeline)
        fig = Figure(figsize=(12, 7.5 + gantt_h))
        # One flat grid (not a nested one), so tight_layout spaces the 2x2 rows as without it.
        grid = fig.add_gridspec(3, 2, height_ratios=(3.75, 3.75, gantt_h))
        reward_ax, time_ax, accept_ax, speed_ax = (fig.add_subplot(grid[i, j])
                                                   for i in (0, 1) for j in (0, 1))
        _draw_gantt(fig.add_subplot(grid[2, :]), timeline)
    for ax in (time_ax, accept_ax, speed_ax):
        ax.sharex(reward_ax)   # one step range everywhere, even on a panel with no data
    steps = _steps(rows)
    reference_label = f"plain decoding ({reference_name or 'reference'})"

    reward_ax.plot(steps, _series(rows, "reward/mean"), marker="o",
                   label="mean over the step's samples")
    reward_ax.set(title="reward", ylabel="reward (verifier score)")
    _legend(reward_ax)

    total, tail = _series(rows, "rollout/time_s"), _series(rows, "rollout/tail_time_s")
    busy = [t - s for t, s in zip(total, tail)]
    time_ax.bar(steps, busy, label="rollout, >= half the samples unfinished")
    time_ax.bar(steps, tail, bottom=busy, label="rollout, long tail (< half unfinished)")
    time_ax.plot(steps, _series(rows, "timing/step_s"), color="k", marker=".",
                 label="whole step (rollout + training)")
    if reference_rows:
        time_ax.plot(_steps(reference_rows), _series(reference_rows, "rollout/time_s"),
                     color="tab:red", linestyle="--", marker=".", label=reference_label)
    time_ax.set(title="time per step", ylabel="time (s)")
    _legend(time_ax)

    if any("rollout/accept_length" in r for r in rows):
        accept_ax.plot(steps, _series(rows, "rollout/accept_length"), marker="o", color="k",
                       label="accept length")
        prefix = "rollout/accept_rate_pos"
        positions = sorted({int(k.removeprefix(prefix)) for r in rows for k in r
                            if k.startswith(prefix)})
        depth_ax = accept_ax.twinx()
        for i in positions:   # pos i is the draft token at depth i + 1
            depth_ax.plot(steps, _series(rows, f"{prefix}{i}"), alpha=0.6,
                          label=f"draft depth {i + 1} accepted (right axis)")
        depth_ax.set(ylim=(0, 1), ylabel="acceptance rate (fraction of verify steps)")
        _legend(accept_ax, depth_ax, ncol=2)
    else:
        accept_ax.text(0.5, 0.5, "no speculation in this run", ha="center",
                       transform=accept_ax.transAxes)
    # 1 token per policy forward is plain decoding: the axis starts at no speedup.
    accept_ax.set_ylim(bottom=1, top=max(2.0, accept_ax.get_ylim()[1]))
    accept_ax.set(title="speculation", ylabel="accept length (tokens / verify step)")

    speed_ax.plot(steps, _series(rows, "rollout/tokens_per_s"), marker="o",
                  label="this run")
    if reference_rows:
        speed_ax.plot(_steps(reference_rows), _series(reference_rows, "rollout/tokens_per_s"),
                      color="tab:red", linestyle="--", marker=".", label=reference_label)
    speed_ax.set(title="rollout throughput", ylabel="throughput (generated tokens / s)")
    if any("drafter/top1_acc" in r for r in rows):   # the drafter trained online
        top1_ax = speed_ax.twinx()
        top1_ax.plot(steps, _series(rows, "drafter/top1_acc"), color="tab:green", marker=".",
                     label="online drafter's top-1 agreement with the policy (right axis)")
        top1_ax.set(ylim=(0, 1), ylabel="top-1 agreement (fraction)")
        _legend(speed_ax, top1_ax)
    else:
        _legend(speed_ax)

    for ax in (reward_ax, time_ax, accept_ax, speed_ax):
        ax.set_xlabel("step (as in metrics.jsonl)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # no step 0.5
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _gantt_steps(timeline: dict[int, list[Span]]) -> list[tuple[int, list[Span]]]:
    return sorted(timeline.items())[-GANTT_STEPS:]


def _gantt_workers(steps: list[tuple[int, list[Span]]]) -> list[str]:
    """rollout0, rollout1, ... (by number: rollout10 after rollout9), then the others by name."""
    names = {s.worker for _, spans in steps for s in spans}
    rollout = [w for w in names if is_rollout_worker(w)]
    number = [int(w.removeprefix("rollout")) if w.removeprefix("rollout").isdigit() else -1
              for w in rollout]
    return ([w for _, w in sorted(zip(number, rollout))]
            + sorted(w for w in names if not is_rollout_worker(w)))


def _gantt_height(timeline: dict[int, list[Span]]) -> float:
    return 1.6 + 0.3 * max(1, len(_gantt_workers(_gantt_steps(timeline))))   # inches


def _draw_gantt(ax: Axes, timeline: dict[int, list[Span]]) -> None:
    """The last GANTT_STEPS steps side by side on one time axis, a row per worker."""
    steps = _gantt_steps(timeline)
    workers = _gantt_workers(steps)
    row = {w: i for i, w in enumerate(workers)}
    bars: dict[str, tuple[list[int], list[float], list[float]]] = {s: ([], [], []) for s in STATES}
    offset = 0.0
    for step, spans in steps:
        ax.axvline(offset, color="k", linewidth=0.6)
        ax.text(offset, 1.0, f" step {step}", transform=ax.get_xaxis_transform(),
                ha="left", va="bottom", fontsize=7)   # as logged, like metrics.jsonl's steps
        for s in spans:
            ys, lefts, widths = bars[s.state]
            ys.append(row[s.worker])
            lefts.append(offset + s.start_s)
            widths.append(s.duration_s)
        # A step lasts until its last span ends; the next one is drawn from there.
        offset += max((s.end_s for s in spans), default=0.0)
    for state in STATES:   # one bar group a state: one legend entry each, in a fixed order
        ys, lefts, widths = bars[state]
        if ys:
            ax.barh(ys, widths, left=lefts, height=0.6, color=STATE_COLORS[state], label=state)
    ax.set_yticks(range(len(workers)), labels=workers)
    ax.set_ylim(max(len(workers), 1) - 0.5, -0.5)   # rollout0 on top; no 0-height view
    ax.set_xlim(0, max(offset, 1e-9))
    n = len(steps)
    ax.set_title(f"worker states (last {n} step{'s' if n > 1 else ''})",
                 pad=14)   # room for the "step N" labels above the axes
    ax.set(xlabel="time (s), the steps side by side", ylabel="worker (rollout replica or actor)")
    _legend(ax, loc="upper left", bbox_to_anchor=(1.0, 1.0))   # outside: bars stay visible


def _steps(rows: Rows) -> list[int]:
    return [r["step"] for r in rows]   # as logged (0-based), so a step reads the same in both


def _series(rows: Rows, key: str) -> list[float]:
    return [r.get(key, float("nan")) for r in rows]   # NaN: a gap where a step lacks the key


def _legend(*axes: Axes, **kwargs: Any) -> None:
    """One legend for an axis and its twin, drawn on the topmost so no line hides it."""
    handles, labels = [], []
    for ax in axes:
        h, lab = ax.get_legend_handles_labels()
        handles += h
        labels += lab
    axes[-1].legend(handles, labels, fontsize=7, **kwargs)
