"""DAPO's dynamic sampling (algorithm.resample_rounds): a step whose groups scored alike draws
more prompts until prompts_per_step groups carry gradient, and trains on the first that do."""

from __future__ import annotations

import pytest

from fastdraft.run import loop
from fastdraft.run.run import Run
from tests.run.test_loop import _cfg


def _scores(per_round):
    """A scorer: round r's rewards from per_round[r](sample index)."""
    calls = []

    def score(run, items, completions):
        rule = per_round[len(calls)]
        calls.append(len(items))
        return [rule(i) for i in range(len(completions))]
    return score, calls


def test_resampling_refills_the_dropped_groups_with_the_first_that_vary(char_policy, tmp_path,
                                                                        monkeypatch):
    run = Run(_cfg(char_policy, "algorithm.skip_zero_variance=true",
                   "algorithm.resample_rounds=2", "algorithm.num_steps=1"), tmp_path / "run")
    # round 0: only group 0 (samples 0-3) varies; round 1: every group varies
    score, calls = _scores([lambda i: float(i == 1), lambda i: float(i % 2)])
    monkeypatch.setattr(loop, "_score", score)
    batches, update = [], run.actor.update
    monkeypatch.setattr(run.actor, "update", lambda batch, **k: batches.append(batch)
                        or update(batch, **k))
    try:
        metrics = loop.train_step(run, 0)
    finally:
        run.finish()
    assert calls == [3, 3] and metrics["rollout/resample_rounds"] == 1.0
    first, more = run.prompts.batch(0, 3), run.prompts.batch(0, 3, round_=1)
    assert [it.ids for it in more] != [it.ids for it in first]   # a stream of its own
    assert [it.ids for it in run.prompts.batch(0, 3, round_=1)] == [it.ids for it in more]
    # group 0 of the first rollout, then the first two of the second: 3 groups of 4
    rows = batches[0].input_ids.tolist()
    assert len(rows) == 12 and metrics["actor/trained_samples"] == 12.0
    expected = [first[0].ids] * 4 + [more[0].ids] * 4 + [more[1].ids] * 4
    assert [row[: len(p)] for row, p in zip(rows, expected)] == expected


def test_without_rounds_left_the_step_trains_on_what_it_has(char_policy, tmp_path, monkeypatch):
    run = Run(_cfg(char_policy, "algorithm.skip_zero_variance=true",
                   "algorithm.resample_rounds=1", "algorithm.num_steps=1"), tmp_path / "run")
    score, calls = _scores([lambda i: 0.0, lambda i: float(i < 2)])   # round 1: group 0 only
    monkeypatch.setattr(loop, "_score", score)
    try:
        metrics = loop.train_step(run, 0)
    finally:
        run.finish()
    assert calls == [3, 3] and metrics["rollout/resample_rounds"] == 1.0
    assert metrics["actor/trained_samples"] == 4.0


def test_resampling_needs_the_groups_to_be_skipped():
    from fastdraft.config.sections.algorithm import AlgorithmConfig
    with pytest.raises(ValueError, match="skip_zero_variance=true"):
        AlgorithmConfig(resample_rounds=2)
    with pytest.raises(ValueError, match="resample_rounds must be >= 0"):
        AlgorithmConfig(resample_rounds=-1, skip_zero_variance=True)
