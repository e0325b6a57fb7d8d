"""StepIO: the static buffers a step reads and writes, and the only host <-> device traffic of
a step: one copy in (the rows' last tokens and positions, from pinned memory) and one copy out
(one float64 row per request: what it accepted, the tokens, their logprobs).

Captured graphs read and write these exact tensors, so they are allocated once, at the
envelope's largest sizes, and steps use leading slices ([:B] rows, [:width] nodes).
"""

from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING

import torch

from fastdraft.engine.envelope import Envelope
from fastdraft.engine.request import Request
from fastdraft.engine.slot_state import SlotSampling
from fastdraft.engine.spec.batch import DraftBatch, DraftBuffers

if TYPE_CHECKING:
    from fastdraft.engine.spec.accept import AcceptedBatch
    from fastdraft.models import HiddenStates


class SamplingMode(IntEnum):
    """What a batch's sampling needs (part of every graph key)."""

    GREEDY = 0      # every row greedy: no random numbers, no softmax tables
    SAMPLED = 1     # some row samples, none filters
    FILTERED = 2    # some row uses top-k / top-p

    @classmethod
    def of(cls, requests: list[Request]) -> SamplingMode:
        if all(r.params.is_greedy for r in requests):
            return cls.GREEDY
        if any(r.params.top_k > 0 or r.params.top_p < 1 for r in requests):
            return cls.FILTERED
        return cls.SAMPLED

    @property
    def needs_filter(self) -> bool:
        return self is SamplingMode.FILTERED


class StepIO:
    def __init__(self, max_batch: int, envelope: Envelope, hidden_size: int, num_aux: int,
                 vocab_size: int, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        pin = device.type == "cuda"
        self._host_in = torch.zeros(2, max_batch, dtype=torch.long, pin_memory=pin)
        self._dev_in = torch.zeros(2, max_batch, dtype=torch.long, device=device)
        self.root_ids, self.root_pos = self._dev_in[0], self._dev_in[1]
        self.sampling = SlotSampling(max_batch, vocab_size, device)
        width = envelope.commit_width
        self.commit_width = width
        # Per row: [num_accepted, num_nodes, tree depth, tokens (W), logprobs (W), sources (W-1)]
        self.out = torch.zeros(max_batch, 3 + 3 * width, dtype=torch.float64, device=device)
        self.drafts = (DraftBuffers(max_batch, envelope.max_tree_nodes, vocab_size, device)
                       if envelope.max_tree_nodes else None)
        # What a step hands the drafter's commit and the hidden-state capture: the accepted
        # tokens + bonus and the policy's hidden states of the tokens before them.
        self.accepted_ids = torch.zeros(max_batch, width, dtype=torch.long, device=device)
        self.num_accepted = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.commit_final = torch.zeros(max_batch, width, hidden_size, dtype=dtype,
                                        device=device)
        self.commit_aux = tuple(torch.zeros(max_batch, width, hidden_size, dtype=dtype,
                                            device=device) for _ in range(num_aux))

    def load(self, token_ids: list[int], positions: list[int], batch: int) -> None:
        """Rows' last tokens and positions; rows past len(token_ids) up to the bucket are
        padding (token 0 at position 0 of a free slot)."""
        n = len(token_ids)
        host = self._host_in
        host[:, :batch] = 0
        host[0, :n] = torch.tensor(token_ids)
        host[1, :n] = torch.tensor(positions)
        self._dev_in[:, :batch].copy_(host[:, :batch], non_blocking=True)

    def read_out(self, num_rows: int) -> list[list[float]]:
        """The step's one device -> host transfer (and its one wait)."""
        return self.out[:num_rows].tolist()

    # ------------------------------------------------------- inside a step's captured stages
    def keep_accepted(self, acc: AcceptedBatch, hidden: HiddenStates, depth: int,
                      with_hidden: bool) -> None:
        """What the drafter's commit (and the capture) read after a verify: the accepted tokens
        + bonus, and the policy's hidden states of the tokens before them (the root, then each
        accepted node)."""
        size, cols = acc.token_ids.shape
        self.accepted_ids[:size, :cols] = acc.token_ids
        self.accepted_ids[:size, cols:] = 0
        self.num_accepted[:size] = acc.num_accepted
        if with_hidden:
            rows = torch.cat([torch.zeros_like(acc.num_accepted).unsqueeze(1),
                              (acc.path + 1).clamp_min(0)], 1).unsqueeze(-1)
            for dst, src in zip((self.commit_final, *self.commit_aux),
                                (hidden.final, *hidden.aux)):
                dst[:size, :cols] = src.gather(1, rows.expand(-1, -1, src.shape[-1]))

    def keep_decoded(self, tokens: torch.Tensor, hidden: HiddenStates, start: int = 0) -> None:
        """The same after a plain decode step of rows start.. (tokens [B], hidden [B, 1, H]):
        one accepted column, the sampled token, so the drafter stays in step while speculation
        is off."""
        rows = slice(start, start + tokens.shape[0])
        self.accepted_ids[rows, 0] = tokens
        self.num_accepted[rows] = 0
        for dst, src in zip((self.commit_final, *self.commit_aux), (hidden.final, *hidden.aux)):
            dst[rows, :1] = src

    def write_plain_out(self, tokens: torch.Tensor, logprobs: torch.Tensor, start: int) -> None:
        """Plain rows start.. of a split step, in write_spec_out's layout: nothing accepted
        from a tree, the sampled token as the bonus."""
        out = self.out[start: start + tokens.shape[0]]
        out.zero_()
        out[:, 3] = tokens
        out[:, 3 + self.commit_width] = logprobs

    def write_spec_out(self, acc: AcceptedBatch, drafts: DraftBatch, depth: int) -> None:
        """The step's one transfer: [num_accepted, num_nodes, tree depth, tokens, logprobs,
        sources of the path's nodes] per row."""
        size, cols = acc.token_ids.shape
        w, width = self.commit_width, drafts.width
        real = torch.arange(width, device=self.device) < drafts.num_nodes.unsqueeze(1)
        out = self.out[:size]
        out.zero_()
        out[:, 0] = acc.num_accepted
        out[:, 1] = drafts.num_nodes
        out[:, 2] = torch.where(real, drafts.depths, 0).amax(1) if width else 0
        out[:, 3: 3 + cols] = acc.token_ids
        out[:, 3 + w: 3 + w + cols] = acc.logprobs
        if width:
            out[:, 3 + 2 * w: 3 + 2 * w + depth] = drafts.sources.gather(
                1, acc.path.clamp_min(0)).double()
