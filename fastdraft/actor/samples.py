"""The online drafter's training samples from the actor's forward instead of the engine's capture.

An engine that hands out no hidden states (vLLM) still rolls out the sequences the actor then
runs forward for the update and the lossless gate; that forward's final hidden states (and
EAGLE-3's aux layer inputs) at positions 0 .. L - 2 are the very features an engine capture
records for a finished request (one model definition serves both), so the samples are the
ones `SampleCollector.on_finish` makes: the first L - 1 tokens, their hidden states, the loss
mask from the first drafted pair on. They differ from captured ones by the forward's numerics
only (batch shape, the actor's compute dtype). The rows the update leaves out
(`algorithm.skip_zero_variance`'s zero-variance groups) get a forward without gradient
(`Actor.hidden_states`, run/loop.py), so the drafter learns from every rollout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastdraft.algo.sequences import SequenceBatch, prompt_lengths, sequence_lengths
from fastdraft.databuffer import Sample
from fastdraft.databuffer.sample import HIDDEN_DTYPE
from fastdraft.drafter.warmup import first_drafted_pair
from fastdraft.errors import FastdraftError
from fastdraft.models import HiddenStates


@dataclass(frozen=True, slots=True)
class RowHidden:
    """One batch row's hidden states at positions 0 .. L - 2 (L: its prompt + answer tokens):
    final [L - 1, H] and EAGLE-3's aux layer inputs, each [L - 1, H], on the host in bf16."""

    final: torch.Tensor
    aux: tuple[torch.Tensor, ...]


def row_hidden(mb: SequenceBatch, hidden: HiddenStates,
               row_states: Callable[[torch.Tensor, int], torch.Tensor]) -> list[RowHidden]:
    """A micro-batch's forward hidden states cut to each row's own L - 1 positions;
    row_states(tensor, row): that row's positions in the forward's layout (packed or padded:
    algo/answer_scores.AnswerScores.row_states)."""
    def cut(t: torch.Tensor, row: int) -> torch.Tensor:
        return row_states(t, row).detach().to("cpu", HIDDEN_DTYPE).clone()
    return [RowHidden(cut(hidden.final, i), tuple(cut(a, i) for a in hidden.aux))
            for i in range(mb.input_ids.shape[0])]


def actor_samples(batch: SequenceBatch, rows: dict[int, RowHidden], request_indices: list[int],
                  rewards: list[float], rl_step: int, policy_version: int) -> list[Sample]:
    """DataBuffer samples of the batch rows in `rows` (batch row -> its hidden states); row r
    is request request_indices[r] of the rollout, scored rewards[r]."""
    lengths = sequence_lengths(batch).tolist()
    prompts = prompt_lengths(batch).tolist()
    out = []
    for r, h in sorted(rows.items()):
        n = lengths[r] - 1   # (hidden t, token t + 1) pairs
        if h.final.shape[0] != n:
            raise FastdraftError(f"batch row {r}: hidden states of {h.final.shape[0]} positions "
                                 f"for a {lengths[r]}-token sequence (expected {n})")
        positions = torch.arange(n)
        out.append(Sample(
            request_index=request_indices[r], policy_version=policy_version, rl_step=rl_step,
            token_ids=batch.input_ids[r, :n], positions=positions, hidden=h.final,
            loss_mask=positions >= first_drafted_pair(prompts[r]), aux_hidden=h.aux,
            reward=rewards[r]))
    return out

