"""Answer extraction, the math reward's normalisation, and the reward registry."""

from __future__ import annotations

import random

import pytest

from fastdraft.data.rewards import (
    available_rewards,
    extract_final_answer,
    get_reward,
    math_reward,
    register_reward,
)
from fastdraft.data.tasks import get_task


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so the answer is \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"\boxed{a{b{c}}d} done", "a{b{c}}d"),
        (r"first \boxed{1}, then \boxed{ 2 }", "2"),  # the last box, stripped
        (r"\boxed{3} and 7 more steps", "3"),  # a box beats a later number
        (r"\boxed{4} then truncated \boxed{5", "4"),  # an unbalanced box is skipped
        (r"cut off \boxed{5 and 6", "6"),  # no balanced box: last number
        ("so x = -7", "-7"),
        ("total: 1,234, as claimed", "1234"),
        ("it costs 1,234,567.50 dollars", "1234567.50"),
        ("pi is about 3.14.", "3.14"),
        ("3-5 steps, then 10-2", "2"),  # a '-' right after a digit is not a minus sign
        ("no answer here", None),
        ("", None),
    ],
)
def test_extract_final_answer(text, expected) -> None:
    assert extract_final_answer(text) == expected


def test_extract_final_answer_non_string() -> None:
    assert extract_final_answer(None) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        (r"\boxed{0.5}", "1/2", 1.0),  # numeric: 1/2 == 0.5 exactly
        (r"\boxed{\frac{3}{4}}", "0.75", 1.0),  # \frac{3}{4} -> 3/4
        ("The answer is $1,234$.", "$1234$", 1.0),  # commas, $ and trailing . dropped
        ("so -3", "-3.0", 1.0),
        (r"\boxed{0.333}", "1/3", 0.0),  # exact, no float tolerance
        ("so 12", "13", 0.0),
        (r"\boxed{x + 1}", "x+1", 1.0),  # non-numeric: spaces dropped, then string equality
        (r"\boxed{x+2}", "x+1", 0.0),
        (r"\boxed{1/0}", "1/0", 1.0),  # not a number (zero denominator): string equality
        ("no answer", "4", 0.0),
        (r"\boxed{", "4", 0.0),  # garbage never raises
    ],
)
def test_math_reward(completion, answer, expected) -> None:
    assert math_reward(completion, answer) == expected


@pytest.mark.parametrize("answer", ["", "  ", None])
def test_empty_reference_is_a_data_error(answer) -> None:
    for name in ("math", "modsum"):
        with pytest.raises(ValueError, match="reference answer"):
            get_reward(name)("42", answer)


def test_registry() -> None:
    assert {"math", "modsum"} <= set(available_rewards())
    assert get_reward("math") is math_reward
    with pytest.raises(ValueError, match=r"unknown reward 'nope'.*math.*modsum"):
        get_reward("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_reward("math")(lambda completion, answer: 0.0)


def test_modsum_reward_matches_the_task_verifier() -> None:
    task = get_task("modsum")
    reward = get_reward("modsum")
    rng = random.Random(0)
    seen = set()
    for _ in range(200):
        problem = task.sample(rng)
        wrong = str((int(problem.answer) + 1) % 10)
        for completion in (problem.solution, "1,2#" + wrong, "no marker", "#", problem.answer):
            got = reward(completion, problem.answer)
            assert got == task.reward(problem, completion)
            seen.add(got)
        assert reward(problem.solution, problem.answer) == 1.0
    assert seen == {0.0, 1.0}
