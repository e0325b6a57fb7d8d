"""Task registry, the modsum task's format, verifier and long-tailed lengths."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from fastdraft.bootstrap.tokenizer import DEFAULT_ALPHABET
from fastdraft.data.tasks import (
    Problem,
    Task,
    available_tasks,
    get_task,
    length_percentiles,
    register_task,
)
from fastdraft.data.tasks.modsum import ModSumTask, extract_answer, make_problem

NUM_SAMPLES = 5000


@pytest.fixture(scope="module")
def problems() -> list[Problem]:
    task = get_task("modsum")
    rng = random.Random(1234)
    return [task.sample(rng) for _ in range(NUM_SAMPLES)]


def parse_digits(prompt: str) -> list[int]:
    assert prompt.endswith("=")
    return [int(tok) for tok in prompt[:-1].split("+")]


# ---- registry ----------------------------------------------------------------------------------


def test_get_task_builds_registered_modsum() -> None:
    task = get_task("modsum", max_terms=10)
    assert isinstance(task, ModSumTask) and task.name == "modsum" and task.max_terms == 10
    assert "modsum" in available_tasks()


def test_unknown_task_names_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown task 'nope'.*modsum"):
        get_task("nope")


def test_register_task_adds_variant_and_rejects_name_clash() -> None:
    @register_task("_test_echo")
    class EchoTask(Task):
        alphabet = "x#"

        def sample(self, rng: random.Random) -> Problem:
            return Problem(prompt="x", solution="#x", answer="x")

        def reward(self, problem: Problem, completion_text: str) -> float:
            return float(completion_text == problem.solution)

    assert isinstance(get_task("_test_echo"), EchoTask) and EchoTask.name == "_test_echo"
    with pytest.raises(ValueError, match="already registered"):
        register_task("modsum")(EchoTask)


def test_problem_is_frozen_and_checked() -> None:
    problem = Problem(prompt="1=", solution="1#1", answer="1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        problem.answer = "2"  # type: ignore[misc]
    with pytest.raises(ValueError, match="does not contain answer"):
        Problem(prompt="1=", solution="1#", answer="7")
    with pytest.raises(ValueError, match="answer is empty"):
        Problem(prompt="1=", solution="1#", answer="")


# ---- modsum format -----------------------------------------------------------------------------


def test_make_problem_exact_format() -> None:
    problem = make_problem([7, 3, 9, 4])
    assert problem == Problem(prompt="7+3+9+4=", solution="7,0,9,3#3", answer="3")
    assert make_problem([5]) == Problem(prompt="5=", solution="5#5", answer="5")
    with pytest.raises(ValueError, match="0-9"):
        make_problem([3, 10])
    with pytest.raises(ValueError, match="non-empty"):
        make_problem([])


def test_every_step_is_local(problems: list[Problem]) -> None:
    for problem in problems[:500]:
        digits = parse_digits(problem.prompt)
        steps_text, answer = problem.solution.split("#")
        steps = [int(s) for s in steps_text.split(",")]
        assert len(steps) == len(digits)
        assert steps[0] == digits[0]
        for prev, digit, step in zip(steps[:-1], digits[1:], steps[1:], strict=True):
            assert step == (prev + digit) % 10
        assert answer == problem.answer == str(sum(digits) % 10)
        assert len(problem.prompt) == 2 * len(digits)
        assert len(problem.solution) == 2 * len(digits) + 1


def test_sampling_is_seeded() -> None:
    task = ModSumTask()
    first = [task.sample(random.Random(7)) for _ in range(3)]
    again = [task.sample(random.Random(7)) for _ in range(3)]
    assert first == again
    rng = random.Random(7)
    assert len({task.sample(rng) for _ in range(50)}) > 40


def test_task_alphabet_within_tokenizer_alphabet(problems: list[Problem]) -> None:
    assert set(ModSumTask.alphabet) <= set(DEFAULT_ALPHABET)
    used = {ch for p in problems for ch in p.prompt + p.solution}
    assert used <= set(ModSumTask.alphabet)


def test_num_terms_stay_in_bounds() -> None:
    task = ModSumTask(min_terms=2, max_terms=5, tail_exponent=0.0)
    rng = random.Random(0)
    counts = {task.sample_num_terms(rng) for _ in range(500)}
    assert counts == {2, 3, 4, 5}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_terms": 0}, "min_terms"),
        ({"min_terms": 5, "max_terms": 4}, "max_terms"),
        ({"tail_exponent": -1.0}, "tail_exponent"),
    ],
)
def test_bad_config_rejected(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModSumTask(**kwargs)


# ---- long tail ---------------------------------------------------------------------------------


def test_solution_lengths_are_long_tailed(problems: list[Problem]) -> None:
    lengths = [len(p.solution) for p in problems]
    pct = length_percentiles(lengths)
    assert 9 <= pct["p50"] <= 20
    assert pct["p99"] / pct["p50"] >= 4
    assert pct["p50"] < pct["p90"] < pct["p99"]
    short = sum(n <= 2 * 8 + 1 for n in lengths) / len(lengths)  # at most 8 terms
    assert short >= 0.7


def test_longest_text_fits_200_chars(problems: list[Problem]) -> None:
    task = ModSumTask()
    longest = max(len(p.prompt) + len(p.solution) + 1 for p in problems)
    assert longest <= task.max_text_chars + 1 < 200
    worst = make_problem([9] * task.max_terms)
    assert len(worst.prompt) + len(worst.solution) == task.max_text_chars


def test_length_percentiles_match_numpy() -> None:
    values = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    pct = length_percentiles(values, qs=(0, 50, 90, 99, 100))
    expected = np.percentile(values, [0, 50, 90, 99, 100])
    assert list(pct) == ["p0", "p50", "p90", "p99", "p100"]
    assert np.allclose(list(pct.values()), expected)
    with pytest.raises(ValueError, match="at least one"):
        length_percentiles([])
    with pytest.raises(ValueError, match="outside"):
        length_percentiles([1.0], qs=(101,))


# ---- verifier ----------------------------------------------------------------------------------


def test_reward_accepts_reference_solutions(problems: list[Problem]) -> None:
    task = ModSumTask()
    assert all(task.reward(p, p.solution) == 1.0 for p in problems)


def test_reward_rejects_wrong_final_answer(problems: list[Problem]) -> None:
    task = ModSumTask()
    for problem in problems[:500]:
        wrong = str((int(problem.answer) + 1) % 10)
        steps, _ = problem.solution.split("#")
        assert task.reward(problem, f"{steps}#{wrong}") == 0.0
        assert task.reward(problem, f"{steps}#{problem.answer}0") == 0.0  # "30" is not "3"


@pytest.mark.parametrize(
    "completion",
    [
        "",
        "7,0,9,3",  # truncated before the marker
        "7,0,9,3#",  # truncated after the marker
        "#",
        "hello world",
        "7,0,9,3 3",
        "\x00\xff<eos>#?",
        "#x3",
        "#4#3",  # the first marker is final
    ],
)
def test_reward_zero_for_garbage_and_truncation(completion: str) -> None:
    task = ModSumTask()
    assert task.reward(make_problem([7, 3, 9, 4]), completion) == 0.0


@pytest.mark.parametrize(
    "completion",
    ["7,0,9,3#3", "#3", "1,2#3", "7,0,9,3# 3", "7,0,9,3#3\n", "7,0,9,3#3<eos><pad>", "#3#3#3#3"],
)
def test_reward_checks_only_the_final_answer(completion: str) -> None:
    """Intermediate steps are not graded; text after the answer digits is ignored."""
    task = ModSumTask()
    assert task.reward(make_problem([7, 3, 9, 4]), completion) == 1.0


def test_reward_never_raises_on_random_text(problems: list[Problem]) -> None:
    task = ModSumTask()
    rng = random.Random(0)
    chars = DEFAULT_ALPHABET + "<>é\x00"
    for problem in problems[:300]:
        text = "".join(rng.choice(chars) for _ in range(rng.randrange(0, 400)))
        assert task.reward(problem, text) in (0.0, 1.0)
    assert task.reward(problems[0], None) == 0.0  # type: ignore[arg-type]


def test_extract_answer() -> None:
    assert extract_answer("1,2#3") == "3"
    assert extract_answer("1,2#") is None
    assert extract_answer("no marker") is None
    assert extract_answer("#12x") == "12"
