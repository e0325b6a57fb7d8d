"""The engine's own settings, plain dataclasses checked at construction (no torch: the recipe
sections build them): speculation (SpecConfig: which proposer drafts, how big its trees are),
the per-step tuner's buckets and arms (TunerConfig; the bandit itself: engine/spec/tuner.py),
length-aware budgets (BudgetConfig; engine/spec/budget.py) and the paged KV cache's block
size. A speculative method's name is checked against the proposers registered with the engine
(engine/spec/setup.py), looked up when a SpecConfig is built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from fastdraft.config.sections.common import OutOfRange, Range, check_ranges
from fastdraft.errors import FastdraftError

#: Cells per block of the paged KV cache (engine/paged_kv.py); 0 in a recipe: static slots.
KV_BLOCK_SIZE = 16

#: The multi-source method: EAGLE's tree with the suffix drafter's candidates grafted in.
MERGED = "eagle+suffix"

#: The largest tree a SpecConfig takes (levels, children a node, nodes verified a request).
MAX_DEPTH, MAX_TOPK, MAX_TOKENS_TO_VERIFY = 64, 64, 4096


def tree_capacity(depth: int, topk: int) -> int:
    """Nodes an EAGLE expansion of this shape draws (engine/spec/draft_layout.py): the root's
    topk children, then topk children of each of the topk nodes expanded per level; the most
    a tree of it can verify."""
    return topk + (depth - 1) * topk * topk


@dataclass(frozen=True, kw_only=True, slots=True)
class SpecConfig:
    """method: "none" (plain decoding), "eagle" (trained drafter), "suffix" (model-free, over
    earlier rollouts of the same prompt) or "eagle+suffix" (both sources in one tree).
    depth: draft levels; topk: children per expanded node and nodes expanded per level;
    tokens_to_verify: tree nodes sent to the policy per request (the verify width)."""

    SECTION: ClassVar[str] = "rollout.spec"

    method: str = "none"
    # Generous caps: a tree of 64 levels, 64 x 64 candidates a level, is far past any that
    # pays; what lies beyond is a typo, named here rather than by a memory plan.
    depth: Annotated[int, Range(ge=1, le=MAX_DEPTH)] = 5
    topk: Annotated[int, Range(ge=1, le=MAX_TOPK)] = 4
    tokens_to_verify: Annotated[int, Range(ge=1, le=MAX_TOKENS_TO_VERIFY)] = 16

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.method != "none":   # the proposers registered with the engine, looked up
            from fastdraft.engine.spec.setup import known_methods
            if self.method not in known_methods():
                raise FastdraftError(f"unknown spec method {self.method!r}; choose one of "
                                     f"{known_methods()}")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def uses_drafter(self) -> bool:
        """Drafts with a trained EAGLE drafter (alone or merged with another source)."""
        return "eagle" in self.method.split("+")


OFF = SpecConfig(method="none")


def arm_name(arm: SpecConfig) -> str:
    """'off' or 'method/depth/topk/tokens_to_verify' (e.g. 'eagle/6/3/12')."""
    if not arm.enabled:
        return "off"
    return f"{arm.method}/{arm.depth}/{arm.topk}/{arm.tokens_to_verify}"


def parse_arm(name: str) -> SpecConfig:
    """The inverse of arm_name; a malformed name says what it expects."""
    if name in ("off", "none"):
        return OFF
    parts = name.split("/")
    try:
        method, depth, topk, nodes = parts[0], *map(int, parts[1:])
    except ValueError:
        raise FastdraftError(f"arm {name!r}: expected 'off' or 'method/depth/topk/tokens_to_verify'"
                             ", e.g. 'eagle/6/3/12'") from None
    try:
        return SpecConfig(method=method, depth=depth, topk=topk, tokens_to_verify=nodes)
    except OutOfRange as err:
        raise FastdraftError(f"arm {name!r}: {err.field} {err.requirement}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class TunerBucket:
    """Batch sizes from min_batch (up to the next bucket's) and the arms played there, the
    prior's favourite first."""

    min_batch: int
    arms: tuple[SpecConfig, ...]

    def __post_init__(self) -> None:
        if self.min_batch < 1:
            raise FastdraftError(f"a tuner bucket's min_batch must be >= 1, got {self.min_batch}")
        if not self.arms:
            raise FastdraftError(f"tuner bucket from batch {self.min_batch} has no arms")
        names = [arm_name(a) for a in self.arms]
        if len(set(names)) != len(names):
            raise FastdraftError(f"tuner bucket from batch {self.min_batch} repeats an arm: "
                                 f"{names}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TunerConfig:
    """buckets: ascending min_batch, the first from batch 1. epsilon: exploration rate;
    window: records per arm the median is taken over; max_age: records older than this many
    steps (of any arm) expire, so an arm that is rarely played is not judged forever on what
    it earned under an older policy or drafter (the policy drifts every RL step);
    min_records: before exploiting, a bucket plays each of its arms (in listed order, the
    prior's favourite first) until it has this many records: a bucket visited for a dozen
    steps a rollout would otherwise take many rollouts of epsilon draws to learn its arms."""

    buckets: tuple[TunerBucket, ...]
    epsilon: float = 0.1
    window: int = 300
    max_age: int = 3000
    min_records: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        starts = [b.min_batch for b in self.buckets]
        if not starts or starts[0] != 1 or starts != sorted(set(starts)):
            raise FastdraftError(f"tuner buckets must start at batch 1 and ascend, got {starts}")
        if not 0.0 <= self.epsilon <= 1.0:
            raise FastdraftError(f"tuner epsilon must be in [0, 1], got {self.epsilon}")
        if self.min_records < 0:
            raise FastdraftError(f"tuner min_records must be >= 0, got {self.min_records}")
        if self.window < 1 or self.max_age < 1:
            raise FastdraftError(f"tuner window and max_age must be >= 1, got {self.window}, "
                                 f"{self.max_age}")

    @property
    def arms(self) -> tuple[SpecConfig, ...]:
        """Every distinct arm, in first-appearance order."""
        seen: dict[str, SpecConfig] = {}
        for bucket in self.buckets:
            for arm in bucket.arms:
                seen.setdefault(arm_name(arm), arm)
        return tuple(seen.values())

    @classmethod
    def from_names(cls, buckets: dict[int, list[str]], **kwargs: Any) -> TunerConfig:
        """{min_batch: ['eagle/6/3/12', 'off', ...]} (a recipe's `rollout.tuner.buckets`)."""
        return cls(buckets=tuple(TunerBucket(min_batch=int(b), arms=tuple(map(parse_arm, arms)))
                                 for b, arms in sorted(buckets.items(), key=lambda kv: int(kv[0]))),
                   **kwargs)

    @classmethod
    def default(cls, spec: SpecConfig, elastic_threshold: int = 32, max_batch: int = 256,
                **kwargs: Any) -> TunerConfig:
        """Arms around the recipe's tree (the largest one allowed): the full tree and two smaller
        ones for small batches; smaller trees and "off" from 8 requests; "off" first (the
        elastic prior) with two small trees from elastic_threshold up. One bucket per power of
        two up to max_batch, so the arms of a bucket are compared at similar batch sizes (a
        step's tokens per second grows with its batch size). A merged spec ("eagle+suffix",
        whose tokens_to_verify counts EAGLE's nodes and the suffix share together) plays its
        merged tree in the tail buckets next to EAGLE-only trees of the same EAGLE size."""
        if not spec.enabled:
            raise FastdraftError("a tuner needs a speculative spec (method != 'none') to build "
                                 "arms")
        merged = spec.method == MERGED
        m = "eagle" if merged else spec.method
        d, k, n = spec.depth, spec.topk, spec.tokens_to_verify

        def arm(depth: int, topk: int, nodes: int, method: str = m) -> SpecConfig:
            return SpecConfig(method=method, depth=max(depth, 1), topk=max(topk, 1),
                              tokens_to_verify=max(nodes, 1))

        mid = max(min(8, elastic_threshold // 2), 2)
        small = [arm(d, k, n), arm(d, k, 2 * n // 3), arm(d - 2, k, n // 2)]
        if merged:  # EAGLE keeps n - min(d, n // 2) nodes of a merged tree of n
            small = [spec, arm(d, k, n - min(d, n // 2)), arm(d, k, 2 * n // 3, spec.method),
                     arm(d - 2, k, n // 2)]
        middle = [arm(d - 2, k, n // 2), arm(d - 3, k - 1, n // 3), OFF]
        large = [OFF, arm(d - 3, k - 1, n // 3), arm(2, 1, 2)]
        starts = sorted({1, mid, elastic_threshold} |
                        {2 ** i for i in range(max(max_batch, 1).bit_length())})
        buckets = [TunerBucket(min_batch=b, arms=tuple(_unique(
            small if b < mid else middle if b < elastic_threshold else large))) for b in starts]
        return cls(buckets=tuple(buckets), **kwargs)


def _unique(arms: list[SpecConfig]) -> list[SpecConfig]:
    seen: dict[str, SpecConfig] = {}
    for arm in arms:
        seen.setdefault(arm_name(arm), arm)
    return list(seen.values())


@dataclass(frozen=True, kw_only=True, slots=True)
class BudgetConfig:
    """window: RL steps of length history kept (older ones describe an older policy);
    margin: a request speculates when its predicted remainder is >= margin x the batch's
    remaining steps (lower: more requests speculate); accept_ema: weight of the newest step in
    the running accept-length estimate; initial_accept_length: that estimate before any step."""

    window: int = 4
    margin: float = 1.0
    accept_ema: float = 0.05
    initial_accept_length: float = 3.0

    def __post_init__(self) -> None:
        if self.window < 1:
            raise FastdraftError(f"budget window must be >= 1 RL step, got {self.window}")
        if self.margin <= 0:
            raise FastdraftError(f"budget margin must be > 0, got {self.margin}")
        if not 0 < self.accept_ema <= 1:
            raise FastdraftError(f"budget accept_ema must be in (0, 1], got {self.accept_ema}")
        if self.initial_accept_length < 1:
            raise FastdraftError("budget initial_accept_length must be >= 1, got "
                                 f"{self.initial_accept_length}")
