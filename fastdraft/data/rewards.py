"""Rule-based rewards for real (non-bootstrap) recipes, registered by name.

Every reward has the signature ``(completion_text: str, answer: str) -> float`` so a recipe can
name its reward without knowing whether it comes from a task verifier or a text rule. A reward
never raises on the completion (policies write garbage and get truncated); an empty or
non-string reference ``answer`` is a data error and raises a FastdraftError.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from fractions import Fraction

from fastdraft.data.tasks import Problem, Task, get_task
from fastdraft.errors import FastdraftError
from fastdraft.utils.registry import Registry

RewardFn = Callable[[str, str], float]
_REWARDS: Registry[RewardFn] = Registry("reward")

_BOXED = "\\boxed{"
# a thousands-grouped number (1,234,567.8) or a plain one; a '-' right after a digit is minus
_NUMBER_RE = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|-?\.\d+")
_RATIONAL_RE = re.compile(r"-?(?:\d+(?:\.\d+)?|\.\d+)(?:/-?(?:\d+(?:\.\d+)?|\.\d+))?")
_FRAC_RE = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register ``fn(completion_text, answer) -> float`` under ``name``."""

    return _REWARDS.register(name)


def available_rewards() -> list[str]:
    """Names of the registered rewards, sorted."""
    return _REWARDS.names()


def get_reward(name: str) -> RewardFn:
    """The reward registered as ``name``."""
    return _REWARDS.get(name)


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` whose braces balance (a truncated one is skipped)."""
    start = text.rfind(_BOXED)
    while start != -1:
        depth, i = 1, start + len(_BOXED)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start + len(_BOXED) : i - 1]
        start = text.rfind(_BOXED, 0, start)
    return None


def extract_final_answer(text: str) -> str | None:
    """The last balanced ``\\boxed{...}`` content, else the last number (commas stripped).

    The box is the model's explicit commitment, so it wins over any number written after it;
    without one, the last number is the usual place a chain of thought ends.
    """
    if not isinstance(text, str):
        return None
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def _normalise(answer: str) -> str:
    """Drop spaces, surrounding ``$`` and a trailing ``.``; ``\\frac{a}{b}`` becomes ``a/b``."""
    answer = re.sub(r"\s+", "", answer).rstrip(".").strip("$").rstrip(".")
    return _FRAC_RE.sub(r"\1/\2", answer)


def _as_number(answer: str) -> Fraction | None:
    """Exact value of an integer, decimal or ``a/b`` (commas stripped), else None."""
    answer = answer.replace(",", "")
    if not _RATIONAL_RE.fullmatch(answer):
        return None
    num, _, den = answer.partition("/")
    try:
        return Fraction(num) / Fraction(den) if den else Fraction(num)
    except ZeroDivisionError:
        return None


def _check_reference(answer: str) -> None:
    if not isinstance(answer, str) or not answer.strip():
        raise FastdraftError(f"reference answer {answer!r}: give a non-empty string")


@register_reward("math")
def math_reward(completion_text: str, answer: str) -> float:
    """1.0 when the final answer matches ``answer``, else 0.0.

    Both sides parse as numbers -> exact rational equality ("0.5" == "1/2" == "\\frac{1}{2}",
    "1,234" == "1234"; no float tolerance, so "0.333" != "1/3"). Otherwise the normalised
    strings must be equal; no symbolic algebra.
    """
    _check_reference(answer)
    found = extract_final_answer(completion_text)
    if found is None:
        return 0.0
    got, ref = _normalise(found), _normalise(answer)
    got_num, ref_num = _as_number(got), _as_number(ref)
    if got_num is not None and ref_num is not None:
        return float(got_num == ref_num)
    return float(got == ref)


@functools.cache
def _modsum_task() -> Task:
    """Built once: the verifier is stateless and the constructor precomputes weights."""
    return get_task("modsum")


@register_reward("modsum")
def modsum_reward(completion_text: str, answer: str) -> float:
    """The modsum task's own verifier, given only the reference answer.

    ``ModSumTask.reward`` reads nothing of the Problem but ``answer``, so a stand-in Problem
    (placeholder prompt, solution = answer) makes it callable with the common signature.
    """
    _check_reference(answer)
    problem = Problem(prompt="<modsum reward>", solution=answer, answer=answer)
    return _modsum_task().reward(problem, completion_text)
