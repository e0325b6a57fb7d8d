"""The actor's logprob of each next token, and the shape of a loss over micro-batches."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fastdraft.algo.sequences import SequenceBatch
from fastdraft.models.decoder import HiddenStates

# (logprobs [b, L - 1] of a micro-batch, the micro-batch) -> (its share of the batch loss,
# metrics summed over micro-batches, each already weighted by the share)
Objective = Callable[[torch.Tensor, SequenceBatch], tuple[torch.Tensor, dict[str, float]]]


def next_token_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids [B, L] -> logits [B, L - 1, V] (column t scores token t + 1), in the model's
    compute dtype."""
    return next_token_logits_and_hidden(model, input_ids)[0]


def next_token_logits_and_hidden(model: torch.nn.Module, input_ids: torch.Tensor,
                                 aux_layers: tuple[int, ...] = ()
                                 ) -> tuple[torch.Tensor, HiddenStates]:
    """next_token_logits, and the same forward's hidden states [B, L, H] (final, and the inputs
    of aux_layers): what an engine's capture gives the drafter, from the actor's forward."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    logits, hidden = model(input_ids, positions, aux_layers=aux_layers)
    return logits[:, :-1], hidden


def logprobs_of(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float
                ) -> torch.Tensor:
    """next_token_logits [B, L - 1, V] -> log-softmax(logits / T) of each next token
    [B, L - 1] (fp32): the quantity the engine reports per sampled token."""
    logits = logits.float() / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)
    return logits.gather(-1, targets).squeeze(-1) - logits.logsumexp(-1)


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, temperature: float
                   ) -> torch.Tensor:
    """input_ids [B, L] -> log-softmax(logits / T) of each next token [B, L - 1] (column t is
    token t + 1 given tokens 0..t)."""
    return logprobs_of(next_token_logits(model, input_ids), input_ids, temperature)
