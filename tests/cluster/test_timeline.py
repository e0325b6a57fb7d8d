"""The cluster timeline is what the Gantt and the idle-time metrics are read from, so: a bad span
is refused when recorded (not when drawn, steps later), the idle fraction counts the rollout
workers' idle and drafter-training time over their span only, and the log behaves like
metrics.jsonl: a resume drops the steps it redoes, and a line cut by a killed run is skipped."""

from __future__ import annotations

import json

import pytest

from fastdraft.observability.timeline import (
    STATES,
    TIMELINE_FILE,
    Span,
    TimelineLog,
    read_timeline,
    spans_metrics,
)


@pytest.mark.parametrize(("args", "match"), [
    (("rollout0", "sleeping", 0.0, 1.0), "'sleeping'"),
    (("rollout0", "generate", -0.5, 1.0), "start_s -0.5"),
    (("rollout0", "generate", 2.0, 1.0), "end_s 1.0"),
    (("rollout0", "generate", 0.0, float("nan")), "end_s nan"),
    (("", "generate", 0.0, 1.0), "worker"),
])
def test_span_refuses_a_bad_state_or_times_naming_the_value(args, match):
    with pytest.raises(ValueError, match=match):
        Span(*args)


def test_span_accepts_every_state_and_a_zero_length_span():
    spans = [Span("rollout0", state, 1.5, 1.5) for state in STATES]
    assert [s.state for s in spans] == list(STATES)
    assert STATES == ("generate", "idle", "train", "update", "push")


def _step_spans() -> list[Span]:
    # Rollout span 0..4 s over 2 rollout workers = 8 worker-seconds, 4 of them idle or training.
    return [
        Span("rollout0", "generate", 0.0, 3.0), Span("rollout0", "idle", 3.0, 4.0),
        Span("rollout1", "generate", 0.0, 1.0), Span("rollout1", "train", 1.0, 3.0),
        Span("rollout1", "idle", 3.0, 4.0),
        # The actor's idle time and its update past the rollout span count for neither.
        Span("actor", "idle", 0.0, 4.0), Span("actor", "update", 4.0, 6.0),
        Span("rollout0", "push", 6.0, 6.5), Span("rollout1", "push", 6.0, 6.5),
    ]


def test_spans_metrics_on_a_hand_case():
    m = spans_metrics(_step_spans(), ["rollout0", "rollout1", "actor"])
    assert m == pytest.approx({
        "cluster/rollout0/generate_s": 3.0, "cluster/rollout0/idle_s": 1.0,
        "cluster/rollout0/train_s": 0.0,
        "cluster/rollout1/generate_s": 1.0, "cluster/rollout1/idle_s": 1.0,
        "cluster/rollout1/train_s": 2.0,
        "cluster/actor/generate_s": 0.0, "cluster/actor/idle_s": 4.0,
        "cluster/actor/train_s": 0.0,
        # Rollout span is 0..6.5 s (the pushes are theirs too): (1 + 1 + 2) / (2 * 6.5).
        "cluster/idle_fraction": 4.0 / 13.0,
    })


def test_idle_fraction_spans_only_rollout_workers_and_is_zero_without_them():
    spans = [Span("rollout0", "generate", 1.0, 2.0), Span("rollout1", "idle", 1.0, 3.0),
             Span("actor", "idle", 0.0, 10.0)]
    # Window 1..3 s (from the first rollout start, not 0; the actor's 10 s do not widen it).
    assert spans_metrics(spans, ["rollout0", "rollout1"])["cluster/idle_fraction"] == (
        pytest.approx(2.0 / (2 * 2.0)))
    assert spans_metrics([Span("actor", "update", 0.0, 5.0)], ["actor"]) == {
        "cluster/actor/generate_s": 0.0, "cluster/actor/idle_s": 0.0,
        "cluster/actor/train_s": 0.0, "cluster/idle_fraction": 0.0}
    assert spans_metrics([], []) == {"cluster/idle_fraction": 0.0}


def _log(run_dir, steps, start_step=0):
    log = TimelineLog(run_dir, start_step=start_step)
    for step in steps:
        log.log(step, [Span("rollout0", "generate", 0.0, 1.0 + step),
                       Span("actor", "update", 1.0 + step, 2.0 + step)])
    log.close()


def test_log_appends_a_json_line_a_step_that_reads_back_as_spans(tmp_path):
    assert read_timeline(tmp_path) == {}   # no cluster in this run
    _log(tmp_path, [0, 1])
    lines = (tmp_path / TIMELINE_FILE).read_text().splitlines()
    assert json.loads(lines[1]) == {"step": 1, "spans": [
        {"worker": "rollout0", "state": "generate", "start_s": 0.0, "end_s": 2.0},
        {"worker": "actor", "state": "update", "start_s": 2.0, "end_s": 3.0}]}
    timeline = read_timeline(tmp_path)
    assert list(timeline) == [0, 1]
    assert timeline[1] == [Span("rollout0", "generate", 0.0, 2.0),
                           Span("actor", "update", 2.0, 3.0)]


def test_log_is_flushed_each_step_for_a_dashboard_drawn_mid_run(tmp_path):
    log = TimelineLog(tmp_path)
    log.log(0, [Span("rollout0", "idle", 0.0, 1.0)])
    assert list(read_timeline(tmp_path)) == [0]   # before close
    log.close()


def test_resume_drops_the_redone_steps_and_appends_after_the_kept_ones(tmp_path):
    _log(tmp_path, [0, 1, 2, 3])
    _log(tmp_path, [2], start_step=2)
    timeline = read_timeline(tmp_path)
    assert list(timeline) == [0, 1, 2]
    assert len((tmp_path / TIMELINE_FILE).read_text().splitlines()) == 3
    assert not [p for p in tmp_path.iterdir() if p.name != TIMELINE_FILE]   # no temp left


def test_a_line_cut_by_a_killed_run_is_skipped_and_not_glued_to_the_next(tmp_path):
    _log(tmp_path, [0, 1])
    path = tmp_path / TIMELINE_FILE
    path.write_text(path.read_text() + '{"step": 2, "spans": [{"worker": "rollo')
    assert list(read_timeline(tmp_path)) == [0, 1]
    _log(tmp_path, [2], start_step=2)   # the resume after the kill
    assert list(read_timeline(tmp_path)) == [0, 1, 2]


def test_a_later_line_for_the_same_step_wins(tmp_path):
    _log(tmp_path, [0])
    with (tmp_path / TIMELINE_FILE).open("a") as f:
        f.write(json.dumps({"step": 0, "spans": [
            {"worker": "rollout0", "state": "idle", "start_s": 0.0, "end_s": 9.0}]}) + "\n")
    assert read_timeline(tmp_path) == {0: [Span("rollout0", "idle", 0.0, 9.0)]}
