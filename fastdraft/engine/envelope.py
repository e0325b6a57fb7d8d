"""Envelope: every cache, scratch and rotary size of an engine, derived in one place from the
longest sequence and the largest speculation it allows. Steps then never check sizes: a request
is admitted only if it fits (`fits`), and everything a step touches lies inside these bounds."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastdraft.errors import FastdraftError

if TYPE_CHECKING:
    from fastdraft.config.engine import SpecConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class Envelope:
    """max_seq_len: prompt + answer tokens a slot holds. The speculation bounds are the largest
    tree a step may draft: depth levels, topk children per expanded node, tokens_to_verify nodes
    sent to the policy (all 0 for an engine that never speculates)."""

    max_seq_len: int
    max_depth: int = 0
    max_topk: int = 0
    max_tree_nodes: int = 0

    def __post_init__(self) -> None:
        if self.max_seq_len < 2:
            raise FastdraftError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if min(self.max_depth, self.max_topk, self.max_tree_nodes) < 0:
            raise FastdraftError("speculation bounds must be >= 0")

    @classmethod
    def for_spec(cls, max_seq_len: int, spec: SpecConfig,
                 arms: Iterable[SpecConfig] = ()) -> Envelope:
        """The envelope of the largest tree among spec and the arms a tuner may pick per step
        (only "none": no tree cells at all)."""
        enabled = [a for a in (spec, *arms) if a.enabled]
        if not enabled:
            return cls(max_seq_len=max_seq_len)
        return cls(max_seq_len=max_seq_len, max_depth=max(a.depth for a in enabled),
                   max_topk=max(a.topk for a in enabled),
                   max_tree_nodes=max(a.tokens_to_verify for a in enabled))

    @staticmethod
    def cells_of(spec: SpecConfig) -> int:
        """Cells past a row's context that one step of `spec`'s trees may write (a tuner's
        smaller arms read and write fewer than the envelope's largest)."""
        if not spec.enabled:
            return 0
        return _tree_cells(spec.tokens_to_verify, spec.depth, spec.topk)

    @property
    def num_draft_scratch(self) -> int:
        """Drafter cells of the nodes a draft tree expands (every level but the last)."""
        return max(self.max_depth - 1, 0) * self.max_topk

    @property
    def tree_cells(self) -> int:
        """Cells past a row's context that a step may write: verify nodes, expanded draft nodes,
        or the tokens a commit appends (at most depth + 1)."""
        if not self.max_tree_nodes:
            return 0
        return _tree_cells(self.max_tree_nodes, self.max_depth, self.max_topk)

    @property
    def cache_len(self) -> int:
        """Cells per slot, policy and drafter alike: the sequence, then the tree cells."""
        return self.max_seq_len + self.tree_cells

    @property
    def rope_len(self) -> int:
        """Rotary positions: a draft node sits up to depth positions past its root."""
        return self.max_seq_len + self.max_depth + 1

    @property
    def commit_width(self) -> int:
        """Columns of a speculative step's accepted tokens: a path of up to max_depth nodes
        plus the bonus token."""
        return self.max_depth + 1


def _tree_cells(nodes: int, depth: int, topk: int) -> int:
    """Verify nodes, expanded draft nodes (every level but the last), or a commit's depth + 1
    tokens: whichever reaches furthest past a row's context."""
    return max(nodes, max(depth - 1, 0) * topk, depth + 1)
