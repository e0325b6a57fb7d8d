"""Batches of Samples for drafter training: packed (sequences back to back in one row) or padded
(one right-padded row per sequence), both as a PackedBatch with the same fields.

Packing wastes no compute on padding when lengths are long-tailed. Sequence boundaries stay exact:
positions restart per sequence (they are the samples' own positions) and attention is
block-diagonal causal, so a packed forward equals each sequence's forward alone. The mask is
built from `segment_ids` on demand ([B, L, L] bool, the form AttnMeta takes for training
forwards); a varlen attention kernel would read `seq_lens` instead.

The existing helpers in fastdraft/models/attn_meta.py build cache and draft-tree masks (they
attend to cache cells by position); none expresses several sequences in one row, hence
`block_causal_mask` here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fastdraft.databuffer.sample import HIDDEN_DTYPE, Sample, SampleKey
from fastdraft.errors import FastdraftError
from fastdraft.models import AttnMeta, HiddenStates

PAD_SEGMENT = -1


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedBatch:
    """B rows of L token slots holding N sequences (packed: B = 1; padded: B = N).

    input_ids [B, L] int64 (0 on padding); positions [B, L] int64 (each sequence's own
    positions, restarting at every boundary; 0 on padding); segment_ids [B, L] int64 (index
    0..N-1 of the sequence a slot holds, -1 on padding); loss_mask [B, L] bool (the samples'
    answer-token masks, False on padding); hidden [B, L, H] bf16; aux_hidden: each [B, L, H]
    bf16 (EAGLE-3 layer inputs; empty for EAGLE-1).
    Per sequence, in segment order: seq_lens [N] int64; rewards [N] float32 (NaN where not
    known yet); policy_versions [N] int64; keys: N (rl_step, request_index).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    segment_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden: torch.Tensor
    aux_hidden: tuple[torch.Tensor, ...]
    seq_lens: torch.Tensor
    rewards: torch.Tensor
    policy_versions: torch.Tensor
    keys: tuple[SampleKey, ...]

    def __post_init__(self) -> None:
        shape = self.input_ids.shape
        assert len(shape) == 2, "input_ids must be [B, L]"
        for name in ("positions", "segment_ids", "loss_mask"):
            assert getattr(self, name).shape == shape, f"{name} must be {tuple(shape)}"
        assert self.hidden.shape[:2] == shape, "hidden must be [B, L, H]"
        assert all(a.shape == self.hidden.shape for a in self.aux_hidden)
        n = len(self.keys)
        assert self.seq_lens.shape == self.rewards.shape == self.policy_versions.shape == (n,)
        assert int(self.seq_lens.sum()) == int((self.segment_ids >= 0).sum())

    @property
    def num_sequences(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens."""
        return int(self.seq_lens.sum())

    @property
    def density(self) -> float:
        """Real tokens / token slots computed (1.0 = no padding)."""
        return self.num_tokens / max(self.input_ids.numel(), 1)

    def attention_mask(self) -> torch.Tensor:
        """[B, L, L] bool block-diagonal causal mask (see block_causal_mask)."""
        return block_causal_mask(self.segment_ids)

    def attn_meta(self) -> AttnMeta:
        """AttnMeta of a cache-free (training) forward over this batch."""
        return AttnMeta(mask=self.attention_mask())

    def hidden_states(self, dtype: torch.dtype = torch.float32) -> HiddenStates:
        """The stored states as the models' HiddenStates record, cast for the loss (lm_head and
        drafter weights are rarely bf16 on the trainer)."""
        return HiddenStates(self.hidden.to(dtype), tuple(a.to(dtype) for a in self.aux_hidden))


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """segment_ids [B, L] (contiguous runs per sequence, -1 = padding) -> [B, L, L] bool: query q
    sees key k iff both hold the same sequence and k <= q. A padding slot sees only itself: a row
    with no visible key would give NaN attention, and NaN * 0 is still NaN in a masked loss."""
    length = segment_ids.shape[-1]
    idx = torch.arange(length, device=segment_ids.device)
    causal = idx.view(-1, 1) >= idx.view(1, -1)
    same = segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)
    real = (segment_ids >= 0).unsqueeze(-1)
    eye = torch.eye(length, dtype=torch.bool, device=segment_ids.device)
    return (same & causal & real) | eye


def _check(samples: Sequence[Sample]) -> None:
    if not samples:
        raise FastdraftError("cannot batch zero samples")
    hidden_size, num_aux = samples[0].hidden_size, len(samples[0].aux_hidden)
    for s in samples:
        if s.hidden_size != hidden_size or len(s.aux_hidden) != num_aux:
            raise FastdraftError(f"sample {s.key} has hidden size {s.hidden_size} and "
                                 f"{len(s.aux_hidden)} aux states, the first has {hidden_size} and "
                                 f"{num_aux}: batch samples of one policy and one drafter kind")


def _per_sequence(samples: Sequence[Sample]) -> dict:
    rewards = [math.nan if s.reward is None else s.reward for s in samples]
    return dict(seq_lens=torch.tensor([s.num_tokens for s in samples], dtype=torch.int64),
                rewards=torch.tensor(rewards, dtype=torch.float32),
                policy_versions=torch.tensor([s.policy_version for s in samples],
                                             dtype=torch.int64),
                keys=tuple(s.key for s in samples))


def pack(samples: Sequence[Sample], token_budget: int, pad_to_budget: bool = False
         ) -> PackedBatch:
    """Concatenates the samples, in order, into one row: B = 1, L = total tokens (<=
    token_budget), or L = token_budget with pad_to_budget (a fixed shape, e.g. for CUDA graphs)."""
    _check(samples)
    total = sum(s.num_tokens for s in samples)
    if token_budget < 1 or total > token_budget:
        raise FastdraftError(f"{len(samples)} samples hold {total} tokens, over the token budget "
                             f"{token_budget}: pack fewer samples or raise token_budget")
    pad = token_budget - total if pad_to_budget else 0
    hidden_size = samples[0].hidden_size

    def row(parts: list[torch.Tensor], fill: torch.Tensor) -> torch.Tensor:
        return torch.cat([*parts, fill.expand(pad, *fill.shape[1:])]).unsqueeze(0)

    zero = torch.zeros(1, dtype=torch.int64)
    zero_h = torch.zeros(1, hidden_size, dtype=HIDDEN_DTYPE)
    segments = [torch.full((s.num_tokens,), i, dtype=torch.int64) for i, s in enumerate(samples)]
    return PackedBatch(
        input_ids=row([s.token_ids for s in samples], zero),
        positions=row([s.positions for s in samples], zero),
        segment_ids=row(segments, torch.full((1,), PAD_SEGMENT, dtype=torch.int64)),
        loss_mask=row([s.loss_mask for s in samples], torch.zeros(1, dtype=torch.bool)),
        hidden=row([s.hidden for s in samples], zero_h),
        aux_hidden=tuple(row([s.aux_hidden[j] for s in samples], zero_h)
                         for j in range(len(samples[0].aux_hidden))),
        **_per_sequence(samples))


def pack_rows(samples: Sequence[Sample], row_len: int | None = None) -> PackedBatch:
    """Packs the samples into as few rows of row_len tokens as first-fit decreasing finds
    (default row_len: the longest sample), each row right-padded. Attention then costs
    rows x row_len^2 rather than one (sum of lengths)^2 row: with dense masked attention (no
    varlen kernels on the CPU), a single long packed row spends most of its attention on
    masked cross-sequence blocks. Segment ids keep the samples' given order (per-sequence
    fields too), so per-sample values line up as in `pack` and `pad`."""
    _check(samples)
    longest = max(s.num_tokens for s in samples)
    row_len = longest if row_len is None else row_len
    if row_len < longest:
        raise FastdraftError(f"row_len={row_len} is shorter than the longest sample ({longest} "
                             "tokens): raise it")
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(samples)), key=lambda i: -samples[i].num_tokens):
        n = samples[i].num_tokens
        slot = next((r for r, room in enumerate(free) if room >= n), None)
        if slot is None:
            rows.append([])
            free.append(row_len)
            slot = len(rows) - 1
        rows[slot].append(i)
        free[slot] -= n
    hidden_size, num_aux = samples[0].hidden_size, len(samples[0].aux_hidden)
    shape = (len(rows), row_len)
    input_ids = torch.zeros(shape, dtype=torch.int64)
    positions = torch.zeros(shape, dtype=torch.int64)
    segment_ids = torch.full(shape, PAD_SEGMENT, dtype=torch.int64)
    loss_mask = torch.zeros(shape, dtype=torch.bool)
    hidden = torch.zeros(*shape, hidden_size, dtype=HIDDEN_DTYPE)
    aux = tuple(torch.zeros(*shape, hidden_size, dtype=HIDDEN_DTYPE) for _ in range(num_aux))
    for r, members in enumerate(rows):
        start = 0
        for i in members:
            s, cols = samples[i], slice(start, start + samples[i].num_tokens)
            input_ids[r, cols], positions[r, cols], segment_ids[r, cols] = (
                s.token_ids, s.positions, i)
            loss_mask[r, cols], hidden[r, cols] = s.loss_mask, s.hidden
            for j, a in enumerate(s.aux_hidden):
                aux[j][r, cols] = a
            start = cols.stop
    return PackedBatch(input_ids=input_ids, positions=positions, segment_ids=segment_ids,
                       loss_mask=loss_mask, hidden=hidden, aux_hidden=aux,
                       **_per_sequence(samples))


def pad(samples: Sequence[Sample]) -> PackedBatch:
    """One right-padded row per sample: B = N, L = the longest sample. The baseline that packing
    is measured against; with positions 0..T-1 its rows also suit a plain causal forward
    (right padding never reaches a real token)."""
    _check(samples)
    n, width = len(samples), max(s.num_tokens for s in samples)
    hidden_size, num_aux = samples[0].hidden_size, len(samples[0].aux_hidden)
    input_ids = torch.zeros(n, width, dtype=torch.int64)
    positions = torch.zeros(n, width, dtype=torch.int64)
    segment_ids = torch.full((n, width), PAD_SEGMENT, dtype=torch.int64)
    loss_mask = torch.zeros(n, width, dtype=torch.bool)
    hidden = torch.zeros(n, width, hidden_size, dtype=HIDDEN_DTYPE)
    aux = tuple(torch.zeros(n, width, hidden_size, dtype=HIDDEN_DTYPE) for _ in range(num_aux))
    for i, s in enumerate(samples):
        t = s.num_tokens
        input_ids[i, :t], positions[i, :t], segment_ids[i, :t] = s.token_ids, s.positions, i
        loss_mask[i, :t], hidden[i, :t] = s.loss_mask, s.hidden
        for j, a in enumerate(s.aux_hidden):
            aux[j][i, :t] = a
    return PackedBatch(input_ids=input_ids, positions=positions, segment_ids=segment_ids,
                       loss_mask=loss_mask, hidden=hidden, aux_hidden=aux,
                       **_per_sequence(samples))
