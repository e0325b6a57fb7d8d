"""Verifiable RL tasks: the Problem record, the Task interface, and the task registry.

A task samples problems with a known answer and scores completions with a rule-based verifier,
so RL runs need no reward model. Tasks register by name (``@register_task("modsum")``) and are
built from recipes with ``get_task(name, **kwargs)``.
"""

from __future__ import annotations

import abc
import difflib
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, is_dataclass
from typing import ClassVar, TypeVar

from fastdraft.errors import FastdraftError


@dataclass(frozen=True, slots=True)
class Problem:
    """One task instance.

    ``prompt``: text given to the policy. ``solution``: the full reference completion (reasoning
    steps, then the final answer line), without EOS, for SFT of the bootstrap policy.
    ``answer``: the final answer string the verifier compares against.
    """

    prompt: str
    solution: str
    answer: str

    def __post_init__(self) -> None:
        if not self.prompt:
            raise FastdraftError("Problem.prompt is empty: a problem needs a prompt")
        if not self.answer:
            raise FastdraftError("Problem.answer is empty: a verifiable problem needs an answer")
        if self.answer not in self.solution:
            raise FastdraftError(
                f"Problem.solution {self.solution!r} does not contain answer {self.answer!r}: "
                "the reference completion must end in the final answer"
            )


class Task(abc.ABC):
    """A verifiable task: ``sample`` draws a problem, ``reward`` scores a completion.

    ``name`` is set by ``register_task``; ``alphabet`` lists every character prompts and
    solutions may contain (the bootstrap tokenizer must cover it).
    """

    name: ClassVar[str] = ""
    alphabet: ClassVar[str] = ""

    @abc.abstractmethod
    def sample(self, rng: random.Random) -> Problem:
        """Draw one problem; the same ``rng`` state gives the same problem."""

    @abc.abstractmethod
    def reward(self, problem: Problem, completion_text: str) -> float:
        """1.0 if ``completion_text`` reaches the correct final answer, else 0.0.

        Must accept any text (garbage, truncated, over-long) and never raise.
        """


_T = TypeVar("_T", bound=type[Task])
_TASKS: dict[str, type[Task]] = {}


def register_task(name: str) -> Callable[[_T], _T]:
    """Class decorator: register a ``Task`` subclass under ``name`` and set its ``name``."""

    def decorate(cls: _T) -> _T:
        if name in _TASKS and _TASKS[name] is not cls:
            raise FastdraftError(f"task name {name!r} is already registered by {_TASKS[name]!r}")
        cls.name = name
        _TASKS[name] = cls
        return cls

    return decorate


def available_tasks() -> list[str]:
    """Names of the registered tasks, sorted."""
    return sorted(_TASKS)


def get_task(name: str, **kwargs: object) -> Task:
    """Build the task registered as ``name`` with constructor ``kwargs`` (its options); an
    unknown name or option is a FastdraftError that lists what there is."""
    try:
        cls = _TASKS[name]
    except KeyError:
        raise FastdraftError(f"unknown task {name!r}: choose one of {available_tasks()}") from None
    options = [f.name for f in fields(cls) if f.init] if is_dataclass(cls) else None
    unknown = sorted(set(kwargs) - set(options)) if options is not None else []
    if unknown:
        hints = {k: difflib.get_close_matches(k, options, n=1) for k in unknown}
        said = ", ".join(f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "")
                         for k, h in hints.items())
        raise FastdraftError(f"task {name!r} has no option {said}: its options are {options}")
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise FastdraftError(f"task {name!r}: {err}") from None


def length_percentiles(
    lengths: Sequence[float], qs: Sequence[float] = (50, 90, 99)
) -> dict[str, float]:
    """Percentiles of ``lengths`` as ``{"p50": ..., "p90": ..., "p99": ...}``.

    Linear interpolation between order statistics (numpy's default), so results match
    ``numpy.percentile``. Used to report how long-tailed answer lengths are.
    """
    if not lengths:
        raise FastdraftError("length_percentiles needs at least one length")
    ordered = sorted(float(x) for x in lengths)
    result: dict[str, float] = {}
    for q in qs:
        if not 0 <= q <= 100:
            raise FastdraftError(f"percentile {q} is outside [0, 100]")
        pos = (len(ordered) - 1) * q / 100
        lo, hi = math.floor(pos), math.ceil(pos)
        value = ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
        result[f"p{q:g}"] = value
    return result
