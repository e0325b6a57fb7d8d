"""The dashboard says what it shows: every line and bar in a legend, every axis labelled with
its unit, integer steps numbered as in metrics.jsonl, accept length from 1 (no speedup), and a
plain-decoding reference drawn dashed only when one is given."""

from __future__ import annotations

import json
import re
import warnings

import pytest

from fastdraft.observability import dashboard
from fastdraft.observability.dashboard import dashboard_figure, draw_dashboard


def _rows(n: int, speculative: bool) -> list[dict[str, float]]:
    rows = []
    for step in range(n):
        row = {"step": step, "reward/mean": 0.1 * step, "rollout/time_s": 2.0 + step,
               "rollout/tail_time_s": 0.5, "timing/step_s": 3.5 + step,
               "rollout/tokens_per_s": 100.0 + 10 * step}
        if speculative:
            row |= {"rollout/accept_length": 1.6 + 0.1 * step, "rollout/accept_rate_pos0": 0.5,
                    "rollout/accept_rate_pos1": 0.3, "drafter/top1_acc": 0.6}
        rows.append(row)
    return rows


def _write_run(path, rows):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _legend_texts(fig) -> set[str]:
    return {t.get_text() for ax in fig.axes if ax.get_legend()
            for t in ax.get_legend().get_texts()}


def _drawn(fig) -> list[tuple[str, list]]:
    """(label, x data) of every line and bar group in the figure."""
    out = [(line.get_label(), list(line.get_xdata())) for ax in fig.axes for line in ax.lines]
    out += [(bars.get_label(), [p.get_x() + p.get_width() / 2 for p in bars.patches])
            for ax in fig.axes for bars in ax.containers]
    return out


def _reference_lines(fig):
    return [line for ax in fig.axes for line in ax.lines
            if line.get_label().startswith("plain decoding")]


@pytest.mark.parametrize("speculative", [True, False])
def test_every_line_has_a_legend_entry_and_every_axis_a_label_with_units(speculative):
    rows = _rows(3, speculative)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # e.g. identical ylim bounds on a plain run
        fig = dashboard_figure(rows, _rows(3, False), reference_name="off")
    legend = _legend_texts(fig)
    drawn = _drawn(fig)
    assert len(drawn) >= (9 if speculative else 6)
    for label, xs in drawn:
        assert not label.startswith("_") and label in legend, label
        assert xs == pytest.approx([r["step"] for r in rows] if "plain" not in label
                                   else [0, 1, 2])   # steps as logged, 0-based
    for ax in fig.axes:
        assert re.search(r"\(.+\)", ax.get_ylabel()), ax.get_ylabel()   # a unit in brackets
        if ax.xaxis.get_visible():   # twin axes share (and hide) their parent's x axis
            assert "metrics.jsonl" in ax.get_xlabel()


def test_step_ticks_are_integers_and_accept_length_starts_at_1():
    fig = dashboard_figure(_rows(3, True))
    for ax in fig.axes:
        ax.get_xlim()   # un-stales the autoscaled view the locator reads
        ticks = ax.xaxis.get_major_locator()()
        assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks
    accept = next(ax for ax in fig.axes if ax.get_ylabel().startswith("accept length"))
    assert accept.get_ylim()[0] == 1
    assert accept.get_ylim()[1] > 1.6 + 0.1 * 2   # the data still fits


def test_reference_is_dashed_in_time_and_throughput_panels_only_when_given(tmp_path,
                                                                            monkeypatch):
    assert _reference_lines(dashboard_figure(_rows(3, True))) == []
    run = _write_run(tmp_path / "on", _rows(3, True))
    off = _write_run(tmp_path / "off", _rows(4, False))
    figures = []
    monkeypatch.setattr(dashboard, "dashboard_figure",
                        lambda *a, **k: figures.append(dashboard_figure(*a, **k)) or figures[-1])
    out = draw_dashboard(run, tmp_path / "d.png", reference=off)
    assert out.stat().st_size > 10_000
    lines = _reference_lines(figures[0])
    assert [line.get_label() for line in lines] == ["plain decoding (off)"] * 2
    assert all(line.get_linestyle() == "--" for line in lines)
    assert {line.axes.get_title() for line in lines} == {"time per step", "rollout throughput"}
    assert list(lines[0].get_xdata()) == [0, 1, 2, 3]


def test_draw_dashboard_writes_run_dir_png_and_refuses_a_speculating_reference(tmp_path):
    run = _write_run(tmp_path / "on", _rows(2, True))
    assert draw_dashboard(run) == run / "dashboard.png" and (run / "dashboard.png").is_file()
    with pytest.raises(ValueError, match="speculates"):
        draw_dashboard(run, reference=_write_run(tmp_path / "other", _rows(2, True)))


def _timeline(steps: int) -> dict:
    from fastdraft.observability.timeline import Span
    return {step: [Span("rollout2", "generate", 0.0, 2.0), Span("rollout2", "idle", 2.0, 3.0),
                   Span("actor", "update", 3.0, 4.0), Span("rollout0", "generate", 0.0, 3.0),
                   Span("rollout0", "train", 3.0, 4.0), Span("rollout10", "push", 4.0, 4.5)]
            for step in range(steps)}


def _gantt(fig):
    return [ax for ax in fig.axes if ax.get_title().startswith("worker states")]


def test_a_cluster_timeline_adds_a_gantt_of_the_last_4_steps_below_the_grid(tmp_path,
                                                                             monkeypatch):
    from fastdraft.observability.timeline import TimelineLog
    figures = []
    monkeypatch.setattr(dashboard, "dashboard_figure",
                        lambda *a, **k: figures.append(dashboard_figure(*a, **k)) or figures[-1])
    run = _write_run(tmp_path / "run", _rows(6, True))
    draw_dashboard(run)
    log = TimelineLog(run)
    for step, spans in _timeline(6).items():
        log.log(step, spans)
    log.close()
    draw_dashboard(run)
    plain, with_gantt = figures
    assert len(with_gantt.axes) == len(plain.axes) + 1 and _gantt(plain) == []
    (gantt,) = _gantt(with_gantt)
    assert gantt.get_title() == "worker states (last 4 steps)"
    assert [t.get_text() for t in gantt.get_yticklabels()] == [
        "rollout0", "rollout2", "rollout10", "actor"]
    assert plain.get_size_inches()[1] == 7.5 < with_gantt.get_size_inches()[1]
    # Every other panel keeps its height: the figure grew by the Gantt's.
    grid_h = [ax.get_position().height * with_gantt.get_size_inches()[1]
              for ax in with_gantt.axes if ax is not gantt]
    plain_h = [ax.get_position().height * 7.5 for ax in plain.axes]
    assert grid_h == pytest.approx(plain_h, rel=0.15)
    # Steps 2..5 side by side, 4.5 s each, a "step N" label at each start; rollout0 on top.
    assert gantt.get_xlim() == pytest.approx((0, 18.0))
    assert [t.get_text().strip() for t in gantt.texts] == ["step 2", "step 3", "step 4", "step 5"]
    assert [line.get_xdata()[0] for line in gantt.lines] == pytest.approx([0, 4.5, 9, 13.5])
    generate = next(c for c in gantt.containers if c.get_label() == "generate")
    assert [p.get_x() for p in generate.patches] == pytest.approx([0, 0, 4.5, 4.5, 9, 9,
                                                                   13.5, 13.5])
    assert [p.get_y() + p.get_height() / 2 for p in generate.patches] == [1, 0] * 4
    assert gantt.get_ylim()[0] > gantt.get_ylim()[1]   # row 0 (rollout0) at the top
    assert [t.get_text() for t in gantt.get_legend().get_texts()] == [
        "generate", "idle", "train", "update", "push"]
    assert re.search(r"\(.+\)", gantt.get_xlabel()) and re.search(r"\(.+\)", gantt.get_ylabel())


def test_an_empty_or_missing_timeline_leaves_the_dashboard_as_it_was(tmp_path):
    rows = _rows(3, False)
    plain = dashboard_figure(rows)
    assert len(dashboard_figure(rows, timeline={}).axes) == len(plain.axes)
    one = dashboard_figure(rows, timeline=_timeline(1))
    assert _gantt(one)[0].get_title() == "worker states (last 1 step)"
    run = _write_run(tmp_path / "run", rows)
    (run / "cluster_timeline.jsonl").write_text('{"step": 0, "spa')   # only a cut line
    draw_dashboard(run)   # no steps: drawn as without the file
