"""Prefilling a GRPO group's prompt once: the loop submits the n samples of a prompt together,
so a prefill batch holds n equal prompts. Only the distinct ones are computed; every row then
takes its prompt's K/V (a copy into its own slot), last-token logits and hidden states, so the
rows go on exactly as if each had been prefilled (the same values: the computed row is theirs).
The EAGLE drafter's prefill runs each distinct prompt's pairs once too (engine/spec/eagle.py),
and the hidden-state capture still sees one row per request."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SharedPrefill:
    """A prefill batch's distinct prompts (first-seen order) and, per row, which one it is."""

    prompts: list[list[int]]
    source: list[int]

    @classmethod
    def of(cls, prompts: list[list[int]], share: bool = True) -> SharedPrefill:
        """share=False: every row computes its own (what sharing saves is measured against)."""
        if not share:
            return cls(list(prompts), list(range(len(prompts))))
        first: dict[tuple[int, ...], int] = {}
        source = [first.setdefault(tuple(p), len(first)) for p in prompts]
        distinct = [None] * len(first)
        for prompt, index in zip(prompts, source):
            distinct[index] = prompt
        return cls(distinct, source)

    @property
    def shared(self) -> bool:
        return len(self.prompts) < len(self.source)

    @property
    def rows_tokens(self) -> int:
        """Prompt tokens of every row: what an unshared prefill computes."""
        return sum(len(self.prompts[i]) for i in self.source)

    @property
    def computed_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def rows(self, device: torch.device) -> torch.Tensor:
        """Row -> its distinct prompt's row in the computed batch [B] (an index tensor)."""
        return torch.tensor(self.source, device=device)
