"""Token sampling for a batch of requests with per-row temperature, top-k, top-p and seeds.

Sampling uses the exponential-race form (argmax of p / E, E ~ Exp(1)), which draws exactly from p
and lets each seeded request take its noise from its own generator, so its tokens do not depend on
which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdraft.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per-row settings as tensors, all [B]; top_k uses vocab_size for 'off'."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    is_greedy: torch.Tensor
    needs_filter: bool
    all_greedy: bool
    any_greedy: bool

    @classmethod
    def build(cls, params: list[SamplingParams], vocab_size: int,
              device: torch.device) -> SamplingTensors:
        greedy = [p.is_greedy for p in params]
        return cls(
            temperature=torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                                     device=device),
            top_k=torch.tensor([vocab_size if p.top_k < 0 else min(p.top_k, vocab_size)
                                for p in params], device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            is_greedy=torch.tensor(greedy, device=device),
            needs_filter=any(p.top_k > 0 or p.top_p < 1 for p in params),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
        )

    def scale_and_filter(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, ..., V] (row b with row b's settings) -> (logits / T, the same with each
        row's top-k / top-p filter applied). Plain sampling and sampled drafting both use it, so
        the draft q and the target p are processed the same way."""
        logits = logits.float()
        batch, vocab = logits.shape[0], logits.shape[-1]
        scaled = logits / self.temperature.view(batch, *[1] * (logits.dim() - 1))
        if not self.needs_filter:
            return scaled, scaled
        per_row = scaled[0, ..., 0].numel()  # positions per batch row
        filtered = filter_top_k_top_p(scaled.reshape(-1, vocab),
                                      self.top_k.repeat_interleave(per_row),
                                      self.top_p.repeat_interleave(per_row))
        return scaled, filtered.view(scaled.shape)


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                       ) -> torch.Tensor:
    """logits [B, V] -> logits with tokens outside each row's top-k / top-p nucleus set to -inf.
    The nucleus keeps the smallest prefix (by descending prob) whose mass reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device).expand_as(logits)
    drop = ranks >= top_k.unsqueeze(-1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_p.unsqueeze(-1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample(logits: torch.Tensor, st: SamplingTensors,
           generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (token_ids [B], logprobs [B]) with logprobs of log-softmax(logits / T)."""
    if st.all_greedy:
        return sample_greedy(logits)
    scaled, filtered = st.scale_and_filter(logits)
    probs = filtered.softmax(dim=-1)
    noise = exponential_noise(probs.shape, generators, probs.device)
    sampled = (probs / noise).argmax(dim=-1)
    token_ids = torch.where(st.is_greedy, scaled.argmax(dim=-1), sampled)
    return token_ids, _chosen_logprob(scaled, token_ids)


def sample_greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (argmax token_ids [B], their log-softmax logprobs [B])."""
    logits = logits.float()
    token_ids = logits.argmax(dim=-1)
    return token_ids, _chosen_logprob(logits, token_ids)


def exponential_noise(shape: torch.Size, generators: list[torch.Generator | None],
                      device: torch.device) -> torch.Tensor:
    """[B, V] Exp(1) noise; rows with a generator draw from it, the others from the global RNG."""
    noise = torch.empty(shape, device=device).exponential_()
    for row, gen in enumerate(generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    return noise


def _chosen_logprob(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    return logits.log_softmax(dim=-1).gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
