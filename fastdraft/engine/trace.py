"""RolloutTrace: when each engine step of a `generate` call started and how many requests were
still unfinished then: enough to tell the busy phase of a rollout from its long tail."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class RolloutTrace:
    num_requests: int = 0
    times: list[float] = field(default_factory=list)     # step start (perf_counter seconds)
    active: list[int] = field(default_factory=list)      # requests unfinished at that start
    arms: list[str] = field(default_factory=list)        # what each step ran (tuner arm names)
    tokens: list[int] = field(default_factory=list)      # tokens each step produced
    drafting: list[int] = field(default_factory=list)    # rows that verified a tree
    end: float = 0.0
    prefill_tokens: int = 0     # prompt tokens of every prefilled row
    prefill_computed: int = 0   # of them computed: a group's equal prompts once (prefix_share)
    preemptions: int = 0        # requests whose KV blocks were taken back (paged_kv.py)
    graph_captures: int = 0     # CUDA graphs captured during the call (engine/graphs.py)
    graph_capture_s: float = 0.0   # their seconds

    def record(self, num_active: int) -> None:
        self.times.append(time.perf_counter())
        self.active.append(num_active)

    def end_step(self, arm: str, num_tokens: int, num_drafting: int = 0) -> None:
        self.arms.append(arm)
        self.tokens.append(num_tokens)
        self.drafting.append(num_drafting)

    def finish(self) -> None:
        self.end = time.perf_counter()

    @property
    def time_s(self) -> float:
        return self.end - self.times[0] if self.times else 0.0

    def tail_time_s(self, fraction: float = 0.5) -> float:
        """Seconds spent while fewer than `fraction` of the requests were still unfinished."""
        bounds = [*self.times[1:], self.end]
        return sum(stop - start for start, stop, n in zip(self.times, bounds, self.active)
                   if n < fraction * self.num_requests)

    def running_over_time(self) -> tuple[list[float], list[int]]:
        """(seconds since the start, unfinished requests) per step: the long-tail picture."""
        start = self.times[0] if self.times else 0.0
        return [t - start for t in self.times], list(self.active)

    @property
    def sd_fraction(self) -> float:
        """Share of the decoding steps (prefills aside) that speculated."""
        steps = [a for a in self.arms if a != "prefill"]
        return sum(a != "off" for a in steps) / len(steps) if steps else 0.0

    @property
    def drafting_row_fraction(self) -> float:
        """Share of the decoding rows (request-steps) that verified a tree: below the
        speculating steps' rows when length-aware budgets left some rows plain."""
        rows = sum(n for a, n in zip(self.arms, self.active) if a != "prefill")
        return sum(self.drafting) / rows if rows else 0.0
