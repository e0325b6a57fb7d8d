"""Rollouts as training tensors: prompt + answer token sequences, right-padded, with the answer
tokens' positions marked and the engine's logprobs aligned to them.

Alignment: logits at position t predict token t + 1, so the answer token at position P + j
(P = prompt length) is scored by the logits at P + j - 1; every per-token tensor here is
[B, L - 1], column t = the prediction of token t + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdraft.errors import FastdraftError


@dataclass(frozen=True, slots=True)
class SequenceBatch:
    input_ids: torch.Tensor         # [B, L] long: prompt + answer, right-padded with 0
    mask: torch.Tensor              # [B, L - 1] bool: column t scores answer token t + 1
    old_logprobs: torch.Tensor      # [B, L - 1] float: the engine's logprobs there (0 elsewhere)
    advantages: torch.Tensor        # [B] float
    sample_weight: torch.Tensor     # [B] float: 0 drops a sequence (a skipped group)

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())

    def rows(self, index: torch.Tensor | list[int]) -> SequenceBatch:
        """A sub-batch (micro-batch), trimmed to its own longest sequence."""
        index = torch.as_tensor(index, dtype=torch.long)
        width = int(_lengths(self.mask[index]).max()) + 1
        return SequenceBatch(self.input_ids[index, :width], self.mask[index, : width - 1],
                             self.old_logprobs[index, : width - 1], self.advantages[index],
                             self.sample_weight[index])

    def to(self, device: torch.device | str) -> SequenceBatch:
        return SequenceBatch(*(t.to(device) for t in (self.input_ids, self.mask,
                                                      self.old_logprobs, self.advantages,
                                                      self.sample_weight)))


def _lengths(mask: torch.Tensor) -> torch.Tensor:
    """[B, L - 1] answer mask -> index of each row's last scored column + 1 (0 if none)."""
    cols = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (mask * cols).amax(1)


def sequence_lengths(batch: SequenceBatch) -> torch.Tensor:
    """Each row's prompt + answer tokens [B] (on the host)."""
    return (_lengths(batch.mask) + 1).cpu()


def prompt_lengths(batch: SequenceBatch) -> torch.Tensor:
    """Each row's prompt tokens [B] (column P - 1 scores the first answer token)."""
    return (batch.mask.int().argmax(1) + 1).cpu()


def build_batch(prompts: list[list[int]], answers: list[list[int]],
                logprobs: list[list[float]], advantages: list[float],
                sample_weight: list[float] | None = None) -> SequenceBatch:
    """One row per sample: prompt ids, answer ids (what the engine generated, EOS included) and
    the engine's logprob of each answer token."""
    if not (len(prompts) == len(answers) == len(logprobs) == len(advantages)):
        raise FastdraftError("prompts, answers, logprobs and advantages must have one entry per "
                             "sample")
    width = max(len(p) + len(a) for p, a in zip(prompts, answers))
    batch = len(prompts)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width - 1, dtype=torch.bool)
    old = torch.zeros(batch, width - 1)
    for row, (p, a, lp) in enumerate(zip(prompts, answers, logprobs)):
        if len(lp) != len(a):
            raise FastdraftError(f"sample {row}: {len(a)} answer tokens but {len(lp)} logprobs")
        ids[row, : len(p) + len(a)] = torch.tensor(p + a)
        start = len(p) - 1
        mask[row, start: start + len(a)] = True
        old[row, start: start + len(a)] = torch.tensor(lp)
    weight = torch.ones(batch) if sample_weight is None else torch.tensor(sample_weight)
    return SequenceBatch(ids, mask, old, torch.tensor(advantages, dtype=torch.float32), weight)


def micro_batches(batch: SequenceBatch, max_tokens: int, packed: bool = False
                  ) -> list[torch.Tensor]:
    """Row indices of micro-batches within max_tokens: their padded size (rows x longest row),
    or with `packed` (sequences end to end, algo/answer_scores.py) their real tokens; a longer
    single row still gets its own micro-batch. Rows are grouped by length, so padding is
    small."""
    lengths = _lengths(batch.mask) + 1
    order = torch.argsort(lengths, stable=True).tolist()
    groups: list[list[int]] = []
    size = 0
    for row in order:
        longest = int(lengths[row])
        grown = size + longest if packed else (len(groups[-1]) + 1) * longest if groups else 0
        if groups and grown <= max_tokens:
            groups[-1].append(row)
            size = grown
        else:
            groups.append([row])
            size = longest
    return [torch.tensor(g) for g in groups]


def empty_batch() -> SequenceBatch:
    """One 2-token row that scores nothing: a rank with fewer micro-batches than its peers runs
    it so that every rank makes the same number of forward/backward passes."""
    return SequenceBatch(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 1, dtype=torch.bool),
                         torch.zeros(1, 1), torch.zeros(1), torch.zeros(1))


def split_across_ranks(batch: SequenceBatch, max_tokens: int, num_ranks: int,
                       packed: bool = False) -> list[list[torch.Tensor | None]]:
    """The batch's micro-batches (`micro_batches`) dealt to ranks, largest first to the rank
    with the fewest tokens (padded, or real when packed) so far; ranks with fewer micro-batches
    get None (an empty one, `empty_batch`) until all have as many. Returns per rank its
    row-index tensors."""
    groups = micro_batches(batch, max_tokens, packed)
    lengths = _lengths(batch.mask) + 1
    cost = [int(lengths[g].sum()) if packed else len(g) * int(lengths[g].max())
            for g in groups]
    plan: list[list[torch.Tensor | None]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    for i in sorted(range(len(groups)), key=lambda i: -cost[i]):
        rank = min(range(num_ranks), key=lambda r: (load[r], len(plan[r])))
        plan[rank].append(groups[i])
        load[rank] += cost[i]
    most = max(len(p) for p in plan)
    return [p + [None] * (most - len(p)) for p in plan]
