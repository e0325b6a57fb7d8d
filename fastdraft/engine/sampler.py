"""Token sampling for a batch of requests with per-row temperature, top-k, top-p and seeds.

A sampled token is drawn by inverse CDF from a counter-based uniform (engine/rng.py): exact,
one uniform per row, and each request's draws depend only on its own seed and position, so its
tokens do not depend on which other requests share the batch. The same functions run eagerly
and inside captured CUDA graphs (no host syncs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdraft.engine.rng import Stream, all_stream_keys
from fastdraft.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per-row settings as tensors, [B]; top_k uses vocab_size for 'off'. keys [B, S]: the row's
    random-stream keys, one per draw site (engine/rng.py; derived from its seed once, when the
    request is admitted)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    is_greedy: torch.Tensor
    keys: torch.Tensor

    def key(self, stream: Stream) -> torch.Tensor:
        return self.keys[:, int(stream) - 1]

    @classmethod
    def build(cls, params: list[SamplingParams], vocab_size: int, device: torch.device | str,
              seeds: list[int] | None = None) -> SamplingTensors:
        return cls(
            temperature=torch.tensor([1.0 if p.is_greedy else p.temperature for p in params],
                                     device=device),
            top_k=torch.tensor([vocab_size if p.top_k < 0 else min(p.top_k, vocab_size)
                                for p in params], device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            is_greedy=torch.tensor([p.is_greedy for p in params], device=device),
            keys=all_stream_keys(torch.tensor(seeds if seeds is not None else [0] * len(params),
                                              dtype=torch.long, device=device)),
        )

    def rows(self, start: int, stop: int) -> SamplingTensors:
        return SamplingTensors(*(t[start:stop] for t in (self.temperature, self.top_k,
                                                         self.top_p, self.is_greedy, self.keys)))

    def scale_and_filter(self, logits: torch.Tensor, needs_filter: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, ..., V] (row b with row b's settings) -> (logits / T, the same with each
        row's top-k / top-p filter applied). Plain sampling and sampled drafting both use it, so
        the draft q and the target p are processed the same way. needs_filter=False: the caller
        knows no row filters (the sort is skipped)."""
        logits = logits.float()
        batch, vocab = logits.shape[0], logits.shape[-1]
        scaled = logits / self.temperature.view(batch, *[1] * (logits.dim() - 1))
        if not needs_filter:
            return scaled, scaled
        per_row = scaled[0, ..., 0].numel()  # positions per batch row
        filtered = filter_top_k_top_p(scaled.reshape(-1, vocab),
                                      self.top_k.repeat_interleave(per_row),
                                      self.top_p.repeat_interleave(per_row))
        return scaled, filtered.view(scaled.shape)


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                       ) -> torch.Tensor:
    """logits [B, V] -> logits with tokens outside each row's top-k / top-p nucleus set to -inf.
    The nucleus keeps the smallest prefix (by descending prob) whose mass reaches top_p. A row
    with top_p = 1 keeps its whole top-k, even where rounding makes the cumulative mass reach 1
    before the last token (its law must not depend on what it is batched with)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device).expand_as(logits)
    drop = ranks >= top_k.unsqueeze(-1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p.unsqueeze(-1)) & (top_p < 1).unsqueeze(-1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [B, V] (rows need not be normalised), uniforms [B] in [0, 1) -> token ids [B].
    Token i is drawn with probability probs[i] / sum(probs) to float64 precision; a token of
    probability 0 is never drawn."""
    cdf = probs.double().cumsum(-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def sample(logits: torch.Tensor, st: SamplingTensors, uniforms: torch.Tensor | None,
           needs_filter: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V], uniforms [B] (None: every row is greedy) -> (token_ids [B], logprobs [B])
    with logprobs of log-softmax(logits / T), the policy's own (before top-k / top-p)."""
    if uniforms is None:
        return sample_greedy(logits)
    scaled, filtered = st.scale_and_filter(logits, needs_filter)
    sampled = inverse_cdf(filtered.softmax(dim=-1), uniforms)
    token_ids = torch.where(st.is_greedy, scaled.argmax(dim=-1), sampled)
    return token_ids, _chosen_logprob(scaled, token_ids)


def sample_greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (argmax token_ids [B], their log-softmax logprobs [B])."""
    logits = logits.float()
    token_ids = logits.argmax(dim=-1)
    return token_ids, _chosen_logprob(logits, token_ids)


def _chosen_logprob(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log-softmax of the chosen tokens only (no [B, V] table of logprobs is materialised)."""
    return logits.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(dim=-1)
