"""What one engine step costs, in seconds, for the cluster simulator: a line in the batch's row
count (decode is memory bound, so a step is mostly a fixed weight read plus a small per-row KV
read), a verify step as a multiple of a plain one plus the drafter's levels, prefill per token,
and the actor's update and weight push. Kept apart from the simulator so that a line fitted to
measurements (`fit`, `from_gpu_bench`) and a hand-written one are the same object; pure Python,
no torch, so projections run anywhere."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from fastdraft.errors import FastdraftError

# The depth of the speculative cycle `fastdraft bench gpu` measures (its STRATEGIES[0]): the
# cycle rows do not repeat it, and importing the bench would import torch. A payload whose
# "graph_memory" part is present names it (its first strategy), and that wins.
BENCH_CYCLE_DEPTH = 6
# The decode variants of the bench's decode rows, fastest first: a real rollout engine runs the
# best one the machine had.
DECODE_VARIANTS = ("compiled_graphs_ms", "graphs_ms", "eager_ms")


@dataclass(frozen=True)
class UnitCosts:
    """Seconds. A plain engine step over `b` rows costs `step_base_s + step_row_s * b`; a
    speculative one costs `verify_factor` plain steps (the wider verify forward, accept and
    commit) plus `draft_levels * draft_level_s` (the drafter's tree, one forward per level).
    An admitted request costs `prefill_token_s` per prompt token (per prompt and generated
    token when it migrates). `update_s` and `push_s`: the actor's update and the weight push
    that close every RL step."""

    step_base_s: float
    step_row_s: float
    verify_factor: float = 1.11
    draft_levels: int = 3
    draft_level_s: float = 0.0
    prefill_token_s: float = 0.0
    update_s: float = 0.0
    push_s: float = 0.0

    def __post_init__(self) -> None:
        # Checked once here: a NaN or negative cost would otherwise surface as a nonsensical
        # projection far from the number that caused it.
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise FastdraftError(f"UnitCosts.{f.name} must be a number, got {value!r}")
            if not (math.isfinite(value) and value >= 0):
                raise FastdraftError(f"UnitCosts.{f.name} must be finite and >= 0, got {value!r}")
        if not float(self.draft_levels).is_integer():
            raise FastdraftError(f"UnitCosts.draft_levels must be a whole number, got "
                                 f"{self.draft_levels!r}")

    def step_s(self, rows: int) -> float:
        """A plain decode step over `rows` rows."""
        return self.step_base_s + self.step_row_s * rows

    def verify_s(self, rows: int) -> float:
        """A speculative step (draft tree, verify, accept, commit) over `rows` rows."""
        return self.step_s(rows) * self.verify_factor + self.draft_levels * self.draft_level_s

    def over_ranks(self, k: int, layers: int, all_reduce_s: float) -> UnitCosts:
        """The costs of a replica tensor-parallel over k devices (models/tensor_parallel.py):
        each reads 1/k of the weights and of a row's KV, and every forward adds two all-reduces
        a layer; the drafter (replicated) costs what it did."""
        if k < 1 or layers < 1 or all_reduce_s < 0:
            raise FastdraftError(f"over_ranks: k ({k}) and layers ({layers}) must be >= 1, "
                                 f"all_reduce_s ({all_reduce_s}) >= 0")
        return UnitCosts(**{**self.__dict__,
                            "step_base_s": self.step_base_s / k + 2 * layers * all_reduce_s,
                            "step_row_s": self.step_row_s / k,
                            "prefill_token_s": self.prefill_token_s / k})

    @classmethod
    def fit(cls, rows: list[int], seconds: list[float], **rest: Any) -> UnitCosts:
        """The least-squares line `seconds = base + row * rows` through measured engine steps,
        each coefficient clamped at 0 (a noisy measurement must not give a step that gets
        cheaper with more rows, or costs less than nothing): with the other refitted under the
        clamp, which is the constrained least-squares optimum. `rest`: the other fields."""
        if len(rows) != len(seconds) or len(rows) < 2:
            raise FastdraftError(f"UnitCosts.fit needs two or more (rows, seconds) pairs of equal "
                                 f"length, got {len(rows)} rows and {len(seconds)} seconds")
        if len(set(rows)) < 2:
            raise FastdraftError(f"UnitCosts.fit needs at least two distinct row counts to fit a "
                                 f"line, got {sorted(set(rows))}")
        n = len(rows)
        mean_x, mean_y = sum(rows) / n, sum(seconds) / n
        sxx = sum((x - mean_x) ** 2 for x in rows)
        sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(rows, seconds))
        slope = sxy / sxx
        base = mean_y - slope * mean_x
        if slope < 0:
            slope, base = 0.0, mean_y
        if base < 0:
            # Through the origin instead; the slope stays >= 0 since seconds are >= 0.
            base = 0.0
            slope = max(sum(x * y for x, y in zip(rows, seconds))
                        / sum(x * x for x in rows), 0.0)
        return cls(step_base_s=base, step_row_s=slope, **rest)

    @classmethod
    def from_gpu_bench(cls, payload: dict[str, Any], *, context: int | None = None,
                       cycle_mode: str = "sampled", **rest: Any) -> UnitCosts:
        """Unit costs from the JSON of `fastdraft bench gpu --json` (fastdraft/bench/gpu_bench):

        - the step line: `fit` through the "decode" rows' (batch_size, best variant's ms), the
          best variant being the first of DECODE_VARIANTS every row has; at one `context` if
          given, else through the rows of every context (the line at their mean context);
        - if "cycle" rows are present (batch 1, context 512): the row of `cycle_mode` (RL
          samples: "sampled") with the smallest draft_vocab (the vocabulary a run would
          deploy) gives verify_factor = (verify_ms + commit_ms) / decode_ms, and
          draft_level_s = draft_tree_ms / depth, draft_levels = depth (the cycle's depth:
          "graph_memory"'s first strategy if present, else BENCH_CYCLE_DEPTH);
        - everything else (prefill, update, push) from `rest`, which also overrides any of
          the above. A missing key raises a FastdraftError naming it."""
        decode = _rows(payload, "decode")
        if context is not None:
            decode = [r for r in decode if _key(r, "context", "decode row") == context]
            if not decode:
                raise FastdraftError(f"bench gpu payload has no decode row at context {context}")
        variant = next((v for v in DECODE_VARIANTS if all(v in r for r in decode)), None)
        if variant is None:
            raise FastdraftError("bench gpu decode rows lack a step time: none of "
                                 f"{DECODE_VARIANTS} "
                                 f"is in every row")
        rows = [int(_key(r, "batch_size", "decode row")) for r in decode]
        seconds = [float(r[variant]) / 1e3 for r in decode]
        derived: dict[str, Any] = {}
        if payload.get("cycle"):
            derived = _cycle_costs(payload, cycle_mode)
        fitted = cls.fit(rows, seconds)
        return cls(step_base_s=fitted.step_base_s, step_row_s=fitted.step_row_s,
                   **{**derived, **rest})


def _rows(payload: dict[str, Any], name: str) -> list[dict[str, Any]]:
    rows = payload.get(name) if isinstance(payload, dict) else None
    if not isinstance(rows, list) or not rows:
        raise FastdraftError(f"bench gpu payload lacks {name!r} rows (run `fastdraft bench gpu` "
                             f"with that part)")
    return rows


def _key(row: dict[str, Any], key: str, where: str) -> Any:
    if key not in row:
        raise FastdraftError(f"bench gpu {where} lacks {key!r}: {sorted(row)}")
    return row[key]


def _cycle_costs(payload: dict[str, Any], mode: str) -> dict[str, Any]:
    rows = [r for r in _rows(payload, "cycle") if r.get("mode") == mode]
    if not rows:
        raise FastdraftError(f"bench gpu cycle rows have no mode {mode!r}")
    row = min(rows, key=lambda r: _key(r, "draft_vocab", "cycle row"))
    decode_ms, verify_ms, commit_ms, tree_ms = (
        float(_key(row, k, "cycle row"))
        for k in ("decode_ms", "verify_ms", "commit_ms", "draft_tree_ms"))
    if decode_ms <= 0:
        raise FastdraftError(f"bench gpu cycle row's decode_ms must be > 0, got {decode_ms}")
    strategies = (payload.get("graph_memory") or {}).get("strategies")
    depth = int(strategies[0][0]) if strategies else BENCH_CYCLE_DEPTH
    return dict(verify_factor=(verify_ms + commit_ms) / decode_ms, draft_levels=depth,
                draft_level_s=tree_ms / depth / 1e3)
