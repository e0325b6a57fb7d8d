"""Per-request sampling settings, checked at construction so bad values fail before any work."""

from __future__ import annotations

from dataclasses import dataclass

from fastdraft.errors import FastdraftError


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """temperature 0 (or greedy=True) means argmax decoding.

    seed: request i of one `generate` call samples from its own generator seeded with seed + i,
    so a call is reproducible, independent of batching, and repeated prompts still differ.
    Returned logprobs are log-softmax(logits / temperature) of the chosen token, before top-k /
    top-p filtering (greedy: temperature 1), i.e. the policy's own log-probability.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    greedy: bool = False
    seed: int | None = None
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise FastdraftError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise FastdraftError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise FastdraftError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise FastdraftError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0
