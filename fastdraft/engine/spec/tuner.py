"""BEG-MAB: the bucketed epsilon-greedy bandit that picks each step's speculation (TLT's
Algorithm 1, DESIGN.md).

An RL rollout starts as a large batch, where verifying drafts costs about what it saves, and
shrinks to a long tail, where speculation pays most. The tuner picks, for every engine step, an
arm (a SpecConfig; "off" is plain decoding) from the bucket of the step's batch size: the
bucket's only arm; else with probability epsilon a random arm of the bucket (explore), otherwise
the arm with the highest median reward over its last `window` records (exploit). Reward =
tokens the step produced per second of the step, measured.

Unlike the reference implementation, whose default groups give one arm per bucket (so it never
explores), every default bucket holds several arms. Elastic speculation ("plain decoding above
a running-request threshold") is the prior, not a rule: in the buckets at and above the
threshold "off" is listed first, and a bucket's first arm is what the tuner plays first (and on
ties); each arm then gets `min_records` steps, and measured rewards decide from there.

Records are kept per (bucket, arm): an arm shared by two buckets is judged in each on the
steps it ran there. The state (reward windows, choice counts, the random generator) is
JSON-able and travels with the run's checkpoint.
"""

from __future__ import annotations

import random
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from fastdraft.config.engine import MERGED, SpecConfig, TunerBucket, TunerConfig, arm_name
from fastdraft.errors import FastdraftError


@dataclass(slots=True)
class ArmRecord:
    """One arm's sliding windows: rewards (tokens / s), tokens per row of its steps, and the
    tuner step each was recorded at."""

    rewards: deque[float]
    tokens_per_row: deque[float]
    ticks: deque[int]
    num_chosen: int = 0

    def expire(self, oldest_tick: int) -> None:
        while self.ticks and self.ticks[0] < oldest_tick:
            for window in (self.ticks, self.rewards, self.tokens_per_row):
                window.popleft()


def record_key(bucket: TunerBucket, arm: SpecConfig) -> str:
    """'min_batch:arm': an arm's records are kept per bucket, so its median is never a mix of
    rewards earned at very different batch sizes."""
    return f"{bucket.min_batch}:{arm_name(arm)}"


@dataclass(slots=True)
class SpecTuner:
    config: TunerConfig
    records: dict[str, ArmRecord] = field(init=False)
    rng: random.Random = field(init=False)
    last_explored: bool = field(init=False, default=False)
    tick: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        w = self.config.window
        self.records = {record_key(b, a): ArmRecord(deque(maxlen=w), deque(maxlen=w),
                                                    deque(maxlen=w))
                        for b in self.config.buckets for a in b.arms}
        self.rng = random.Random(self.config.seed)

    def bucket(self, batch_size: int) -> TunerBucket:
        if batch_size < 1:
            raise FastdraftError(f"batch_size must be >= 1, got {batch_size}")
        return [b for b in self.config.buckets if b.min_batch <= batch_size][-1]

    def select(self, batch_size: int) -> SpecConfig:
        """The arm for a step over batch_size running requests."""
        bucket = self.bucket(batch_size)
        arms = bucket.arms
        self.last_explored = False
        self.tick += 1
        for arm in arms:
            self.records[record_key(bucket, arm)].expire(self.tick - self.config.max_age)
        if len(arms) == 1:
            choice = arms[0]
        elif self.rng.random() < self.config.epsilon:
            choice, self.last_explored = self.rng.choice(arms), True
        else:
            choice = self._best(bucket)
        self.records[record_key(bucket, choice)].num_chosen += 1
        return choice

    def _best(self, bucket: TunerBucket) -> SpecConfig:
        """The first arm with fewer than min_records records (in listed order); else the highest
        median reward, ties to the earlier arm; the first (prior) arm while none has any."""
        for arm in bucket.arms:
            if len(self.records[record_key(bucket, arm)].rewards) < self.config.min_records:
                return arm
        best, best_reward = bucket.arms[0], float("-inf")
        for arm in bucket.arms:
            rewards = self.records[record_key(bucket, arm)].rewards
            if rewards and (median := statistics.median(rewards)) > best_reward:
                best, best_reward = arm, median
        return best

    def record(self, arm: SpecConfig, num_tokens: int, batch_size: int, elapsed_s: float
               ) -> None:
        """One step of `arm`: num_tokens produced by batch_size rows in elapsed_s seconds."""
        if elapsed_s <= 0 or batch_size < 1:
            return
        rec = self.records[record_key(self.bucket(batch_size), arm)]
        rec.rewards.append(num_tokens / elapsed_s)
        rec.tokens_per_row.append(num_tokens / batch_size)
        rec.ticks.append(self.tick)

    def median_rewards(self) -> dict[str, float]:
        """{'min_batch:arm': median tokens per second} of the records kept."""
        return {name: statistics.median(r.rewards) for name, r in self.records.items()
                if r.rewards}

    def state_dict(self) -> dict[str, Any]:
        """JSON-able: the windows, the choice counts and the generator's state."""
        version, internal, gauss = self.rng.getstate()
        return {"arms": {name: {"rewards": list(r.rewards), "tokens_per_row":
                                list(r.tokens_per_row), "ticks": list(r.ticks),
                                "num_chosen": r.num_chosen}
                         for name, r in self.records.items()},
                "tick": self.tick, "rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a saved state; (bucket, arm) pairs the config no longer has are dropped, new
        ones start empty (a recipe may change its arms between runs)."""
        for name, saved in state["arms"].items():
            if name in self.records:
                rec = self.records[name]
                for window, key in ((rec.rewards, "rewards"), (rec.ticks, "ticks"),
                                    (rec.tokens_per_row, "tokens_per_row")):
                    window.clear()
                    window.extend(saved[key])
                rec.num_chosen = int(saved["num_chosen"])
        self.tick = int(state["tick"])
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))



def check_tuner(tuner: TunerConfig | None, spec: SpecConfig) -> SpecTuner | None:
    """The engine's tuner over `spec`'s proposer: every arm drafts with spec.method or is off."""
    if tuner is None:
        return None
    if not spec.enabled:
        raise FastdraftError("a tuner picks among speculative arms: set spec.method (e.g. 'eagle') "
                             "or drop the tuner")
    # The merged proposer also drafts EAGLE-only trees (its suffix share is then empty).
    allowed = {spec.method, "eagle"} if spec.method == MERGED else {spec.method}
    other = sorted({a.method for a in tuner.arms if a.enabled and a.method not in allowed})
    if other:
        raise FastdraftError(f"tuner arms draft with {other} but the engine's proposer is "
                             f"{spec.method!r}: every arm must use one of {sorted(allowed)} or be "
                             "'off'")
    return SpecTuner(tuner)
