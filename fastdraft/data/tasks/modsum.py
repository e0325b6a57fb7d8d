"""``modsum``: running sum of digits mod 10, a verifiable task with long-tailed answer lengths.

Real reasoning RL has mostly short answers and a few very long ones; that tail sets rollout time,
which is what fastdraft speeds up. This task reproduces it cheaply. Format::

    prompt:   "7+3+9+4="
    solution: "7,0,9,3#3"

The solution lists the running sum mod 10 after each term (step i = (step i-1 + digit i) mod 10,
so each step is computable from the previous step and the next prompt digit), then ``#`` and the
final answer. The number of terms follows a truncated power law P(n) ∝ n^-tail_exponent on
[min_terms, max_terms]: with the defaults half the problems have <= 5 terms, 1% have >= 35.
A problem with n terms has a prompt of 2n characters and a solution of 2n+1.
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass, field

from fastdraft.data.tasks.base import Problem, Task, register_task
from fastdraft.errors import FastdraftError

ANSWER_MARKER = "#"
STEP_SEP = ","
_ANSWER_RE = re.compile(r"\s*(\d+)")


@register_task("modsum")
@dataclass(frozen=True, kw_only=True)
class ModSumTask(Task):
    """Running digit sum mod 10; ``reward`` checks only the final answer after ``#``."""

    alphabet = "0123456789+=,#"

    min_terms: int = 3
    max_terms: int = 40
    tail_exponent: float = 2.0
    _cum_weights: tuple[float, ...] = field(init=False, repr=False, compare=False)

    @property
    def max_prompt_chars(self) -> int:
        """The longest prompt this task draws: max_terms digits, each followed by + or =."""
        return 2 * self.max_terms

    def __post_init__(self) -> None:
        if self.min_terms < 1:
            raise FastdraftError(f"min_terms={self.min_terms}: set it to 1 or more")
        if self.max_terms < self.min_terms:
            raise FastdraftError(
                f"max_terms={self.max_terms} < min_terms={self.min_terms}: raise max_terms"
            )
        if self.tail_exponent < 0:
            raise FastdraftError(
                f"tail_exponent={self.tail_exponent}: use >= 0 (0 = uniform, larger = lighter tail)"
            )
        weights = (n**-self.tail_exponent for n in range(self.min_terms, self.max_terms + 1))
        object.__setattr__(self, "_cum_weights", tuple(itertools.accumulate(weights)))

    @property
    def max_text_chars(self) -> int:
        """Longest prompt + solution in characters (= tokens with the char tokenizer)."""
        return 4 * self.max_terms + 1

    def sample_num_terms(self, rng: random.Random) -> int:
        """Draw the number of terms from the truncated power law."""
        terms = range(self.min_terms, self.max_terms + 1)
        return rng.choices(terms, cum_weights=self._cum_weights)[0]

    def sample(self, rng: random.Random) -> Problem:
        num_terms = self.sample_num_terms(rng)
        digits = [rng.randrange(10) for _ in range(num_terms)]
        return make_problem(digits)

    def reward(self, problem: Problem, completion_text: str) -> float:
        answer = extract_answer(completion_text)
        return 1.0 if answer is not None and answer == problem.answer else 0.0


def make_problem(digits: list[int]) -> Problem:
    """The modsum problem for ``digits`` (each 0-9), with its step-by-step solution."""
    if not digits or any(not 0 <= d <= 9 for d in digits):
        raise FastdraftError(f"digits {digits!r}: give a non-empty list of integers 0-9")
    steps = list(itertools.accumulate(digits, lambda total, d: (total + d) % 10))
    answer = str(steps[-1])
    prompt = "+".join(map(str, digits)) + "="
    solution = STEP_SEP.join(map(str, steps)) + ANSWER_MARKER + answer
    return Problem(prompt=prompt, solution=solution, answer=answer)


def extract_answer(completion_text: str) -> str | None:
    """The digits right after the first ``#`` (leading spaces allowed), or None.

    The first marker is final: the policy commits to its answer when it writes ``#``, and
    whatever it writes after the answer digits (e.g. when it misses EOS) is ignored. Text with no
    marker (truncated or garbage) or no digits after it has no answer.
    """
    if not isinstance(completion_text, str):
        return None
    _, marker, rest = completion_text.partition(ANSWER_MARKER)
    if not marker:
        return None
    match = _ANSWER_RE.match(rest)
    return match.group(1) if match else None
