"""Length-aware budgets (engine/spec/budget.py): the survival-conditioned length prediction, the
DAS rule for which rows speculate, the history window and the saved state."""

from __future__ import annotations

import pytest

from fastdraft.config.engine import BudgetConfig
from fastdraft.engine.request import prompt_key
from fastdraft.engine.spec.budget import LengthBudget

SHORT, LONG = prompt_key([5, 6, 7]), prompt_key([9, 9, 9, 9])


def _budget(**kwargs) -> LengthBudget:
    budget = LengthBudget(BudgetConfig(**kwargs))
    for length in (10, 20, 30, 100):
        budget.record(SHORT, length)
    budget.record(LONG, 400)
    budget.advance_step()
    return budget


def test_prediction_is_the_mean_remainder_of_longer_earlier_answers():
    budget = _budget()
    assert budget.predict_remaining(SHORT, 0) == pytest.approx((10 + 20 + 30 + 100) / 4)
    assert budget.predict_remaining(SHORT, 25) == pytest.approx((30 + 100) / 2 - 25)
    # Past every answer of its prompt: every prompt's history (only 400 is longer).
    assert budget.predict_remaining(SHORT, 150) == pytest.approx(250)
    # Past everything seen: as long again as it already is.
    assert budget.predict_remaining(SHORT, 500) == 500
    assert budget.predict_remaining(prompt_key([1, 2]), 0) == pytest.approx(112)   # unseen prompt


def test_answers_of_the_running_step_count_from_the_next_step():
    budget = LengthBudget(BudgetConfig())
    budget.record(SHORT, 10)
    assert budget.predict_remaining(SHORT, 0) == 1      # no history yet
    budget.advance_step()
    assert budget.predict_remaining(SHORT, 0) == 10


def test_history_older_than_the_window_is_dropped():
    budget = _budget(window=2)
    budget.record(SHORT, 50)
    budget.advance_step()
    assert budget.predict_remaining(SHORT, 0) == pytest.approx((10 + 20 + 30 + 100 + 50) / 5)
    budget.advance_step()
    assert budget.predict_remaining(SHORT, 0) == 50


def test_rows_predicted_to_finish_within_the_batch_horizon_do_not_speculate():
    budget = LengthBudget(BudgetConfig(initial_accept_length=4.0))
    # The longest needs 400 / 4 = 100 more steps: rows predicted under 100 tokens decode plainly.
    assert budget.speculating([400, 150, 100, 99, 3]) == [True, True, True, False, False]
    budget = LengthBudget(BudgetConfig(initial_accept_length=4.0, margin=0.5))
    assert budget.speculating([400, 150, 100, 99, 3]) == [True, True, True, True, False]
    for _ in range(200):        # the accept length is measured: at 1 token a step, all plain
        budget.observe(1.0)      # but the longest (it alone sets the horizon)
    assert budget.speculating([400, 150, 3]) == [True, False, False]


def test_state_round_trips():
    budget = _budget()
    budget.record(LONG, 7)      # pending: joins at the next step
    budget.observe(6.0)
    restored = LengthBudget(BudgetConfig())
    restored.load_state_dict(budget.state_dict())
    assert restored.state_dict() == budget.state_dict()
    for prompt, current in ((SHORT, 0), (SHORT, 25), (LONG, 10), (prompt_key([3]), 2)):
        assert restored.predict_remaining(prompt, current) == budget.predict_remaining(prompt,
                                                                                       current)
    budget.advance_step()
    restored.advance_step()
    assert restored.predict_remaining(LONG, 0) == budget.predict_remaining(LONG, 0) == 203.5


@pytest.mark.parametrize("kwargs, match", [({"window": 0}, "window"), ({"margin": 0}, "margin"),
                                           ({"accept_ema": 0}, "accept_ema"),
                                           ({"initial_accept_length": 0.5}, "initial")])
def test_bad_config_says_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BudgetConfig(**kwargs)
