"""Losses over a PackedBatch that give the same value packed, padded or one sequence at a time.

The reduction chosen: a mean over each sequence's scored tokens, then a mean over the sequences
that have any. Every rollout weighs the same whatever its length (as reward weights, one per
rollout, assume), and the value cannot depend on how sequences were grouped into rows. A scored
pair never crosses a sequence boundary: in a packed row, slot t + 1 may already belong to the
next sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastdraft.databuffer.packing import PackedBatch
from fastdraft.errors import FastdraftError

Metrics = dict[str, float]


def shifted_valid(batch: PackedBatch, shift: int = 1) -> torch.Tensor:
    """[B, L] bool: True at slot t when slot t + shift holds the same sequence and is a loss-mask
    (answer) token, i.e. a prediction made at t for the token `shift` ahead may be scored."""
    if shift < 1:
        raise FastdraftError(f"shift must be >= 1, got {shift}")
    seg, mask = batch.segment_ids, batch.loss_mask
    valid = torch.zeros_like(mask)
    if shift < seg.shape[1]:
        valid[:, :-shift] = ((seg[:, shift:] == seg[:, :-shift]) & (seg[:, :-shift] >= 0)
                             & mask[:, shift:])
    return valid


def per_sequence_mean(values: torch.Tensor, valid: torch.Tensor, batch: PackedBatch
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """values [B, L] float, valid [B, L] bool -> (mean of each sequence's valid values [N]
    (0 where it has none), number of valid slots [N])."""
    n = batch.num_sequences
    seg = batch.segment_ids.clamp_min(0).flatten()
    weight = valid.flatten().to(values.dtype)
    sums = torch.zeros(n, dtype=values.dtype, device=values.device)
    counts = torch.zeros(n, dtype=values.dtype, device=values.device)
    # where(), not a product: a non-finite value on an unscored slot must not leak into the sum.
    sums = sums.index_add(0, seg, torch.where(valid.flatten(), values.flatten(), 0.0))
    counts = counts.index_add(0, seg, weight)
    return sums / counts.clamp_min(1), counts


def token_ce_loss(logits: torch.Tensor, batch: PackedBatch) -> tuple[torch.Tensor, Metrics]:
    """Next-token cross-entropy of logits [B, L, V] against the batch's own tokens, scored where
    the next token is an answer token of the same sequence; per-sequence mean, then the mean over
    sequences with at least one scored token."""
    targets = torch.zeros_like(batch.input_ids)
    targets[:, :-1] = batch.input_ids[:, 1:]
    ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    valid = shifted_valid(batch, 1)
    per_seq, counts = per_sequence_mean(ce.view_as(targets), valid, batch)
    scored = counts > 0
    loss = per_seq[scored].sum() / scored.sum().clamp_min(1)
    return loss, {"loss": loss.item(), "scored_tokens": float(counts.sum()),
                  "scored_sequences": float(scored.sum())}
