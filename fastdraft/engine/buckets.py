"""Batch-size and context-length buckets: a step is padded up to one of a few shapes, so a few
captured CUDA graphs serve every batch the scheduler forms. Plain Python, tested on the CPU.

Rows past the running requests are padding (free slots: token 0 at position 0, outputs
discarded); cells past a row's own length are masked. Where nothing is captured (the CPU) the
ladders can be exact (`exact=True`), so eager steps pad nothing."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from fastdraft.errors import FastdraftError


@dataclass(frozen=True, slots=True)
class BucketPlan:
    batch_sizes: tuple[int, ...]     # ascending; the last is the engine's max batch size
    context_lens: tuple[int, ...]    # ascending; the last is the cache length

    def __post_init__(self) -> None:
        for name, ladder in (("batch_sizes", self.batch_sizes),
                             ("context_lens", self.context_lens)):
            if not ladder or list(ladder) != sorted(set(ladder)) or ladder[0] < 1:
                raise FastdraftError(f"{name} must be ascending positive sizes, got {ladder}")

    @classmethod
    def build(cls, max_batch_size: int, cache_len: int, *, exact: bool = False,
              min_context: int = 256) -> BucketPlan:
        """Graph ladders: batch 1, 2, 4, 8, then every 8 up to 64, then every 32; contexts are
        powers of two from min_context, then the cache length. exact=True: every size is its
        own bucket (eager steps, nothing to capture)."""
        if exact:
            return cls(tuple(range(1, max_batch_size + 1)), tuple(range(1, cache_len + 1)))
        sizes = [b for b in (1, 2, 4) if b < max_batch_size]
        b = 8
        while b < max_batch_size:
            sizes.append(b)
            b += 8 if b < 64 else 32
        contexts = []
        c = min_context
        while c < cache_len:
            contexts.append(c)
            c *= 2
        return cls((*sizes, max_batch_size), (*contexts, cache_len))

    def batch_bucket(self, num_rows: int) -> int:
        return _ceil(self.batch_sizes, num_rows, "batch size")

    def context_bucket(self, num_cells: int) -> int:
        return _ceil(self.context_lens, num_cells, "context length")


def _ceil(ladder: tuple[int, ...], value: int, what: str) -> int:
    i = bisect_left(ladder, value)
    if i == len(ladder):
        raise FastdraftError(f"{what} {value} exceeds the largest bucket {ladder[-1]}")
    return ladder[i]
