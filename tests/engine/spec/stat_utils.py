"""Reusable statistical harness: does a sampler's output follow an exactly known distribution?

Typical use (any sampler that yields token sequences, e.g. an end-to-end engine test):

    expected = exact_sequence_probs(lambda ctx: next_token_probs(ctx), length=3, vocab_size=V)
    observed = Counter(tuple(seq) for seq in samples)
    check = chi_square_test(observed, expected)
    assert check.pvalue > 0.01, check.describe()

Cells whose expected count is below `min_expected` are pooled (smallest first) so the chi-square
approximation holds; observing an outcome of probability 0 gives p-value 0 at once.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from scipy import stats

Outcome = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ChiSquareResult:
    statistic: float
    dof: int
    pvalue: float
    num_samples: int
    num_cells: int                 # after pooling
    impossible: tuple[Outcome, ...]  # observed outcomes with expected probability 0
    worst: tuple[tuple[Outcome, int, float], ...]  # (outcome, observed, expected count), top 5

    def describe(self) -> str:
        worst = ", ".join(f"{o}: obs {c} exp {e:.1f}" for o, c, e in self.worst)
        return (f"chi2={self.statistic:.1f} dof={self.dof} p={self.pvalue:.3g} "
                f"n={self.num_samples} cells={self.num_cells} "
                f"impossible={list(self.impossible)[:5]} worst=[{worst}]")


def chi_square_test(observed_counts: Mapping[Outcome, int], expected_probs: Mapping[Outcome, float],
                    min_expected: float = 5.0) -> ChiSquareResult:
    """Pearson chi-square goodness of fit of counts to a distribution (probs summing to ~1)."""
    total_p = sum(expected_probs.values())
    if not math.isclose(total_p, 1.0, abs_tol=1e-6):
        raise ValueError(f"expected_probs must sum to 1, got {total_p}")
    n = sum(observed_counts.values())
    if n == 0:
        raise ValueError("no observations")
    impossible = tuple(o for o, c in observed_counts.items()
                       if c > 0 and expected_probs.get(o, 0.0) <= 0.0)
    cells = [(expected_probs[o] * n, observed_counts.get(o, 0), o)
             for o in expected_probs if expected_probs[o] > 0]
    cells.sort(key=lambda cell: cell[0])
    pooled = _pool_rare(cells, min_expected)
    stat = sum((obs - exp) ** 2 / exp for exp, obs in pooled)
    dof = len(pooled) - 1
    pvalue = 0.0 if impossible else (float(stats.chi2.sf(stat, dof)) if dof > 0 else 1.0)
    worst = sorted(cells, key=lambda cell: -((cell[1] - cell[0]) ** 2 / cell[0]))[:5]
    return ChiSquareResult(statistic=stat, dof=dof, pvalue=pvalue, num_samples=n,
                           num_cells=len(pooled), impossible=impossible,
                           worst=tuple((o, obs, exp) for exp, obs, o in worst))


def chi_square_pvalue(observed_counts: Mapping[Outcome, int],
                      expected_probs: Mapping[Outcome, float], min_expected: float = 5.0) -> float:
    """p-value of `chi_square_test` (0.0 when an impossible outcome was observed)."""
    return chi_square_test(observed_counts, expected_probs, min_expected).pvalue


def _pool_rare(cells: list[tuple[float, int, Outcome]], min_expected: float
               ) -> list[tuple[float, int]]:
    """cells sorted by expected count ascending -> [(expected, observed)] with every expected
    count >= min_expected: neighbouring (in that order) cells are merged until large enough; a
    too-small remainder joins the last merged cell."""
    out: list[tuple[float, int]] = []
    pool_exp, pool_obs = 0.0, 0
    for exp, obs, _ in cells:
        pool_exp, pool_obs = pool_exp + exp, pool_obs + obs
        if pool_exp >= min_expected:
            out.append((pool_exp, pool_obs))
            pool_exp, pool_obs = 0.0, 0
    if pool_exp > 0.0:
        if out:
            exp, obs = out.pop()
            pool_exp, pool_obs = pool_exp + exp, pool_obs + obs
        out.append((pool_exp, pool_obs))
    return out


def exact_sequence_probs(next_probs: Callable[[Outcome], Sequence[float]], length: int,
                         vocab_size: int, stop_token_ids: Iterable[int] = (),
                         min_prob: float = 0.0) -> dict[Outcome, float]:
    """All continuations of `length` tokens (shorter if one ends at a stop token) with their exact
    probability prod_t next_probs(prefix)[token_t]; next_probs(prefix) -> [V] probabilities.
    Outcomes of probability <= min_prob are dropped (their branches are not expanded)."""
    stops = set(stop_token_ids)
    out: dict[Outcome, float] = {}
    frontier: list[tuple[Outcome, float]] = [((), 1.0)]
    for _ in range(length):
        nxt: list[tuple[Outcome, float]] = []
        for prefix, prob in frontier:
            row = next_probs(prefix)
            for tok in range(vocab_size):
                pr = prob * float(row[tok])
                if pr <= min_prob:
                    continue
                if tok in stops:
                    out[(*prefix, tok)] = pr
                else:
                    nxt.append(((*prefix, tok), pr))
        frontier = nxt
    out.update(frontier)
    return out


def counts_of(samples: Iterable[Sequence[int]], length: int | None = None) -> Counter[Outcome]:
    """Counter of sample tuples, each truncated to `length` tokens when given."""
    return Counter(tuple(s[:length] if length is not None else s) for s in samples)


def all_sequences(vocab_size: int, length: int) -> list[Outcome]:
    return list(itertools.product(range(vocab_size), repeat=length))
