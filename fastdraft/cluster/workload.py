"""The work of one RL step as the cluster simulator sees it: every request's answer length, in
GRPO groups. Either recorded from a real run (`load_shapes`: JSON lines, one a step) or drawn
from a synthetic long-tailed law (`long_tail_lengths`), because rollout time is set by the tail
of the answer lengths, not their mean, and the tail is what dispatch and consolidation act on."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

from fastdraft.errors import FastdraftError

# The share of the log-length variance that a prompt's group shares (its difficulty): samples of
# one prompt are closer to each other than to other prompts' samples, which is what makes whole
# groups long or short and dispatch of whole groups matter. Synthetic, a modelling choice.
PROMPT_SHARE = 0.5


@dataclass(frozen=True)
class StepShape:
    """One RL step: `lengths[i]` answer tokens of request i, groups of `group_size` contiguous;
    `prompt_tokens` per request (prefill); `predicted`: the lengths dispatch believes (a length
    predictor's guesses), None for the actual ones. Lists are stored as tuples."""

    lengths: tuple[int, ...]
    group_size: int
    prompt_tokens: int = 0
    predicted: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", tuple(self.lengths))
        if self.predicted is not None:
            object.__setattr__(self, "predicted", tuple(self.predicted))
        if not self.lengths:
            raise FastdraftError("StepShape.lengths must not be empty")
        if not all(_is_int(n) and n >= 1 for n in self.lengths):
            raise FastdraftError("StepShape.lengths must be whole numbers >= 1 (tokens)")
        if not (_is_int(self.group_size) and self.group_size >= 1):
            raise FastdraftError(f"StepShape.group_size must be >= 1, got {self.group_size!r}")
        if len(self.lengths) % self.group_size:
            raise FastdraftError(f"StepShape.lengths ({len(self.lengths)}) must be whole groups of "
                                 f"group_size {self.group_size}")
        if not (_is_int(self.prompt_tokens) and self.prompt_tokens >= 0):
            raise FastdraftError("StepShape.prompt_tokens must be >= 0, got "
                                 f"{self.prompt_tokens!r}")
        if self.predicted is not None and (
                len(self.predicted) != len(self.lengths)
                or not all(isinstance(p, int | float) and math.isfinite(p) and p >= 0
                           for p in self.predicted)):
            raise FastdraftError("StepShape.predicted must hold one finite length >= 0 per request")

    @property
    def num_groups(self) -> int:
        return len(self.lengths) // self.group_size

    @property
    def predicted_lengths(self) -> tuple[int | float, ...]:
        return self.lengths if self.predicted is None else self.predicted


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def long_tail_lengths(n: int, group_size: int, mean: float, p99_over_mean: float, max_len: int,
                      seed: int) -> list[int]:
    """`n` synthetic answer lengths (tokens), groups of `group_size` contiguous: lognormal with
    the given mean and 99th percentile / mean (before clipping to [1, max_len], which lowers
    both a little). Each group shares a per-prompt log-scale carrying PROMPT_SHARE of the
    variance. Reproducible from `seed` (random.Random). Not measured data: a stand-in for
    recorded shapes (`load_shapes`) when projecting."""
    if n < 1 or group_size < 1 or n % group_size:
        raise FastdraftError(f"long_tail_lengths: n ({n}) must be a positive multiple of "
                             f"group_size ({group_size})")
    if not (mean >= 1 and max_len >= 1):
        raise FastdraftError(f"long_tail_lengths: mean ({mean}) and max_len ({max_len}) must be "
                             ">= 1")
    sigma = _sigma_for(p99_over_mean)
    mu = math.log(mean) - sigma * sigma / 2  # E[exp(N(mu, sigma^2))] = mean
    prompt_sigma = sigma * math.sqrt(PROMPT_SHARE)
    sample_sigma = sigma * math.sqrt(1 - PROMPT_SHARE)
    rng = random.Random(seed)
    lengths = []
    for _ in range(n // group_size):
        scale = mu + rng.gauss(0.0, prompt_sigma)
        for _ in range(group_size):
            value = math.exp(scale + rng.gauss(0.0, sample_sigma))
            lengths.append(min(max(round(value), 1), max_len))
    return lengths


def _sigma_for(p99_over_mean: float) -> float:
    """The lognormal sigma whose p99 / mean is the given ratio: exp(z*s - s^2/2) = r, the smaller
    root (the larger one has a mean dominated by the far tail). r tops out at exp(z^2/2) ~ 15."""
    z = NormalDist().inv_cdf(0.99)
    top = math.exp(z * z / 2)
    if not 1 <= p99_over_mean < top:
        raise FastdraftError(f"long_tail_lengths: p99_over_mean must be in [1, {top:.1f}) for a "
                             f"lognormal, got {p99_over_mean}")
    return z - math.sqrt(z * z - 2 * math.log(p99_over_mean))


def load_shapes(path: str | Path) -> list[StepShape]:
    """Steps from JSON lines, one a step: {"step": int, "group_size": int, "lengths": [...],
    "prompt_tokens": int (default 0), "predicted": [...] (optional)}, in file order; blank lines
    are skipped. A bad line raises a FastdraftError naming the file and line."""
    shapes = []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            shapes.append(StepShape(lengths=tuple(row["lengths"]), group_size=row["group_size"],
                                    prompt_tokens=row.get("prompt_tokens", 0),
                                    predicted=row.get("predicted")))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise FastdraftError(f"{path}:{number}: not a step shape ({type(exc).__name__}: "
                                 f"{exc})") from None
    return shapes


def save_shapes(shapes: list[StepShape], path: str | Path) -> None:
    """Writes `shapes` as `load_shapes` reads them (step = position in the list)."""
    out = []
    for step, shape in enumerate(shapes):
        row: dict = {"step": step, "group_size": shape.group_size,
                     "lengths": list(shape.lengths), "prompt_tokens": shape.prompt_tokens}
        if shape.predicted is not None:
            row["predicted"] = list(shape.predicted)
        out.append(json.dumps(row) + "\n")
    Path(path).write_text("".join(out), encoding="utf-8")
