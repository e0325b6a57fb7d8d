"""Speculation statistics, per request and aggregated per generate() call."""

from __future__ import annotations

from dataclasses import dataclass, field

SOURCE_NAMES = {0: "eagle", 1: "suffix"}


@dataclass(slots=True)
class SpecStats:
    """num_drafted: tree nodes sent to the policy; num_accepted: draft tokens it accepted;
    num_verify_steps: policy forwards that verified a tree (each also yields one bonus token).
    accepted_by_pos[i] / drafted_by_pos[i]: acceptance of the draft token at depth i + 1."""

    num_drafted: int = 0
    num_accepted: int = 0
    num_verify_steps: int = 0
    drafted_by_pos: list[int] = field(default_factory=list)
    accepted_by_pos: list[int] = field(default_factory=list)
    accepted_by_source: dict[str, int] = field(default_factory=dict)

    @property
    def accept_length(self) -> float:
        """Tokens per verify step, vLLM's definition: 1 + accepted / verify steps."""
        return 1.0 + self.num_accepted / self.num_verify_steps if self.num_verify_steps else 1.0

    def accept_rate_by_pos(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_pos, self.drafted_by_pos)]

    def record(self, num_drafted: int, max_depth: int, accepted_sources: list[int]) -> None:
        """One verify step: a tree of num_drafted nodes and depth max_depth, of which the path
        of accepted_sources (proposer id per accepted token, root to leaf) was accepted."""
        self.num_verify_steps += 1
        self.num_drafted += num_drafted
        self.num_accepted += len(accepted_sources)
        _grow(self.drafted_by_pos, max_depth)
        _grow(self.accepted_by_pos, max_depth)
        for depth in range(max_depth):
            self.drafted_by_pos[depth] += 1
        for depth, source in enumerate(accepted_sources):
            self.accepted_by_pos[depth] += 1
            name = SOURCE_NAMES.get(source, str(source))
            self.accepted_by_source[name] = self.accepted_by_source.get(name, 0) + 1

    def record_row(self, row: list[float], commit_width: int, num_kept: int) -> None:
        """One verify step from its row of the step's transfer (StepIO.write_spec_out); only
        the accepted draft tokens the request kept count (a stop token or the length limit
        cuts a path): num_kept = tokens the request appended, bonus included."""
        kept = min(int(row[0]), num_kept)
        start = 3 + 2 * commit_width
        self.record(int(row[1]), int(row[2]), [int(s) for s in row[start: start + kept]])

    def merge(self, other: SpecStats) -> None:
        self.num_drafted += other.num_drafted
        self.num_accepted += other.num_accepted
        self.num_verify_steps += other.num_verify_steps
        for mine, theirs in ((self.drafted_by_pos, other.drafted_by_pos),
                             (self.accepted_by_pos, other.accepted_by_pos)):
            _grow(mine, len(theirs))
            for i, v in enumerate(theirs):
                mine[i] += v
        for name, v in other.accepted_by_source.items():
            self.accepted_by_source[name] = self.accepted_by_source.get(name, 0) + v

    def as_metrics(self) -> dict[str, float]:
        out = {"rollout/accept_length": self.accept_length,
               "rollout/drafted_tokens": float(self.num_drafted),
               "rollout/accepted_tokens": float(self.num_accepted)}
        for i, rate in enumerate(self.accept_rate_by_pos()):
            out[f"rollout/accept_rate_pos{i}"] = rate
        return out


def _grow(values: list[int], length: int) -> None:
    values.extend([0] * (length - len(values)))
