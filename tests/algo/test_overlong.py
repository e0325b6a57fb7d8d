"""DAPO's overlong shaping (algo/overlong.py): the soft punishment over the budget's last
tokens, the filtering of answers cut at the budget, and both in an RL step."""

from __future__ import annotations

import pytest

from fastdraft.algo.objective import Algorithm
from fastdraft.algo.overlong import overlong_penalty, shape_overlong
from fastdraft.config.sections import AlgorithmConfig
from fastdraft.errors import FastdraftError


def test_the_soft_punishment_falls_linearly_over_the_buffer():
    # L_max 100, L_cache 20: nothing up to 80 tokens, then down to -1 at 100
    assert [overlong_penalty(n, 100, 20) for n in (10, 80, 81, 90, 100, 101)] == \
        pytest.approx([0.0, 0.0, -0.05, -0.5, -1.0, -1.0])
    assert overlong_penalty(100, 100, 0) == 0.0   # buffer 0: off


def test_filtering_drops_the_cut_answers_and_the_advantages_see_the_punishment():
    shaped, kept = shape_overlong([1.0, 1.0, 0.0, 0.0], [50, 95, 100, 30],
                                  [False, False, True, False], 100, 20, True)
    assert shaped == pytest.approx([1.0, 0.25, -1.0, 0.0]) and kept == [1.0, 1.0, 0.0, 1.0]
    algo = Algorithm(AlgorithmConfig(overlong_filter=True, overlong_buffer=20), 1.0,
                     max_tokens=100)
    adv, weights = algo.advantages([1.0, 1.0, 0.0, 0.0], 4, [50, 95, 100, 30],
                                   [False, False, True, False])
    assert weights == [1.0, 1.0, 0.0, 1.0]
    assert adv[0] > adv[1] > adv[3] > adv[2]   # the punished long answer ranks below its peer
    plain = Algorithm(AlgorithmConfig(), 1.0, max_tokens=100)
    assert plain.advantages([1.0, 1.0, 0.0, 0.0], 4)[1] == [1.0] * 4
    with pytest.raises(FastdraftError, match="overlong shaping needs"):
        algo.advantages([1.0, 1.0, 0.0, 0.0], 4)


def test_the_buffer_must_fit_the_budget(char_policy):
    from tests.run.test_loop import _cfg
    with pytest.raises(ValueError, match=r"overlong_buffer=10 .* < rollout.max_new_tokens=10"):
        _cfg(char_policy, "algorithm.overlong_buffer=10")
    with pytest.raises(ValueError, match="overlong_buffer must be >= 0"):
        AlgorithmConfig(overlong_buffer=-1)


def test_a_step_leaves_the_cut_answers_out_of_the_update(char_policy, tmp_path, monkeypatch):
    from fastdraft.run import loop
    from fastdraft.run.run import Run
    from tests.run.test_loop import _cfg
    run = Run(_cfg(char_policy, "algorithm.overlong_filter=true", "algorithm.overlong_buffer=4",
                   "algorithm.num_steps=1", "rollout.max_new_tokens=40"), tmp_path / "run")
    completions, batches = [], []
    rollout, update = loop.rollout, run.actor.update
    monkeypatch.setattr(loop, "rollout", lambda *a, **k: completions.extend(rollout(*a, **k))
                        or completions)
    monkeypatch.setattr(run.actor, "update", lambda batch, **k: batches.append(batch)
                        or update(batch, **k))
    try:
        loop.train_step(run, 0)
    finally:
        run.finish()
    cut = [c.finish_reason == "length" for c in completions]
    print(f"{cut.count(True)} of {len(cut)} answers cut at 40 tokens")
    assert 0 < cut.count(True) < len(cut)   # an untrained policy: some stop, some run on
    assert batches[0].input_ids.shape[0] == cut.count(False)   # only finished answers train
