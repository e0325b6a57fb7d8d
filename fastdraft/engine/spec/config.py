"""SpecConfig: which proposer drafts and how big its trees are."""

from __future__ import annotations

from dataclasses import dataclass

from fastdraft.errors import FastdraftError

#: The multi-source method: EAGLE's tree with the suffix drafter's candidates grafted in.
MERGED = "eagle+suffix"


@dataclass(frozen=True, kw_only=True, slots=True)
class SpecConfig:
    """method: "none" (plain decoding), "eagle" (trained drafter), "suffix" (model-free, over
    earlier rollouts of the same prompt) or "eagle+suffix" (both sources in one tree).
    depth: draft levels; topk: children per expanded node and nodes expanded per level;
    tokens_to_verify: tree nodes sent to the policy per request (the verify width)."""

    method: str = "none"
    depth: int = 5
    topk: int = 4
    tokens_to_verify: int = 16

    def __post_init__(self) -> None:
        from fastdraft.engine.spec.setup import known_methods
        if self.method not in known_methods():
            raise FastdraftError(f"unknown spec method {self.method!r}; choose one of "
                                 f"{known_methods()}")
        if self.depth < 1 or self.topk < 1 or self.tokens_to_verify < 1:
            raise FastdraftError("depth, topk and tokens_to_verify must be >= 1, got "
                                 f"{self.depth}, {self.topk}, {self.tokens_to_verify}")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def uses_drafter(self) -> bool:
        """Drafts with a trained EAGLE drafter (alone or merged with another source)."""
        return "eagle" in self.method.split("+")
