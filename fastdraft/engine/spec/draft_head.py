"""The drafter's output layer: the policy's frozen lm_head over the whole vocabulary, or over a
subset of draft tokens (FR-Spec / EAGLE-3's `draft_vocab_size`: the most frequent tokens). A
draft over the subset is still verified losslessly (tokens outside it simply have q = 0); it
makes each draft level read far fewer lm_head bytes, which is most of a draft level's cost on
a large-vocabulary policy. A drafter with an lm_head of its own (an imported EAGLE-3) scores its
own draft vocabulary, in its own row order."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastdraft.drafter.base import Drafter
from fastdraft.errors import FastdraftError


class DraftHead:
    def __init__(self, drafter: Drafter, token_ids: torch.Tensor | None = None) -> None:
        """token_ids [Vd] long: the draft vocabulary as target token ids (None: all tokens)."""
        self.drafter = drafter
        vocab = drafter.config.vocab_size
        if drafter.head is not None:   # its rows are its draft vocabulary, in draft order
            own = drafter.draft_token_ids
            if token_ids is not None and (own is None or not torch.equal(
                    torch.as_tensor(token_ids, dtype=torch.long), own.cpu())):
                raise FastdraftError("this drafter has an lm_head of its own over its draft "
                                     "vocabulary: it drafts over that vocabulary only")
            token_ids = own
        if token_ids is not None:
            token_ids = torch.as_tensor(token_ids, dtype=torch.long)
            if token_ids.dim() != 1 or not len(token_ids) or len(set(token_ids.tolist())) != len(
                    token_ids) or int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab:
                raise FastdraftError(f"draft token ids must be distinct ids in [0, {vocab})")
            token_ids = token_ids.to(next(drafter.parameters()).device)
        self.token_ids = token_ids
        self.weight: torch.Tensor | None = None
        self.refresh()

    @property
    def vocab_size(self) -> int:
        return self.drafter.config.vocab_size if self.token_ids is None else len(self.token_ids)

    def refresh(self) -> None:
        """Re-gathers the subset's rows after the policy's lm_head changed in place (an own
        lm_head is read where it lives)."""
        if self.token_ids is not None and self.drafter.head is None:
            self.weight = self.drafter.lm_head_weight().index_select(0, self.token_ids)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Drafter output features [..., H] -> draft logits [..., Vd]."""
        x = self.drafter.head_input(out)
        return self.drafter.lm_head(x) if self.weight is None else F.linear(x, self.weight)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> target token ids."""
        return draft_ids if self.token_ids is None else self.token_ids[draft_ids]
