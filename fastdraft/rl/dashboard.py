"""The run's dashboard: one PNG with reward, rollout time and its tail share, accept length and
per-position acceptance, and tokens per second, per step (read from metrics.jsonl, so
`fastdraft plot RUN_DIR` redraws it for any run, finished or not); with online drafter
training, the drafter's top-1 agreement with the policy too."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from fastdraft.rl.metrics import read_metrics

DASHBOARD_FILE = "dashboard.png"


def draw_dashboard(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir} has no logged steps yet")
    steps = [r["step"] + 1 for r in rows]

    def series(key: str) -> list[float]:
        return [r.get(key, float("nan")) for r in rows]

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0][0]
    ax.plot(steps, series("reward/mean"), marker="o")
    ax.set(title="reward (mean over samples)", xlabel="step")
    ax = axes[0][1]
    total, tail = series("rollout/time_s"), series("rollout/tail_time_s")
    ax.bar(steps, [t - s for t, s in zip(total, tail)], label="busy (>= half running)")
    ax.bar(steps, tail, bottom=[t - s for t, s in zip(total, tail)], label="long tail")
    ax.plot(steps, series("timing/step_s"), color="k", marker=".", label="whole step")
    ax.set(title="rollout time per step (s)", xlabel="step")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    ax.plot(steps, series("rollout/accept_length"), marker="o", color="k", label="accept length")
    positions = sorted({k for r in rows for k in r if k.startswith("rollout/accept_rate_pos")},
                       key=lambda k: int(k.removeprefix("rollout/accept_rate_pos")))
    twin = ax.twinx()
    for key in positions:
        twin.plot(steps, series(key), alpha=0.6, label=key.removeprefix("rollout/accept_rate_"))
    twin.set_ylim(0, 1)
    ax.set(title="speculation: accept length (left), acceptance by position (right)",
           xlabel="step")
    if positions:
        twin.legend(fontsize=7, ncol=2)
    ax = axes[1][1]
    ax.plot(steps, series("rollout/tokens_per_s"), marker="o", label="rollout tokens / s")
    ax.set(title="rollout tokens / s", xlabel="step")
    if any("drafter/top1_acc" in r for r in rows):   # the drafter trained online
        twin = ax.twinx()
        twin.plot(steps, series("drafter/top1_acc"), color="tab:green", marker=".",
                  label="drafter top-1 (online training)")
        twin.set_ylim(0, 1)
        twin.legend(fontsize=7, loc="lower right")
        ax.set(title="rollout tokens / s; online drafter's top-1 agreement (right)")
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    out = Path(out) if out is not None else run_dir / DASHBOARD_FILE
    fd, tmp = tempfile.mkstemp(suffix=".png", dir=out.parent)
    os.close(fd)
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, out)
    return out
