"""The reduced draft vocabulary as the engines store it: `d2t` (int64 offsets, target id =
d2t[i] + i for draft index i) and `t2d` (bool membership over the target vocabulary).

fastdraft keeps the same information as `draft_token_ids` (target ids in draft order); the lm_head
rows an export writes follow that order, so d2t must too."""

from __future__ import annotations

import torch

from fastdraft.errors import FastdraftError


def reduced_draft_token_ids(draft_token_ids: torch.Tensor | None, vocab_size: int
                            ) -> torch.Tensor | None:
    """Validated draft ids as int64, or None when drafting scores the whole vocabulary (no ids,
    or as many ids as tokens: then the full lm_head in target order drafts the same tokens)."""
    if draft_token_ids is None:
        return None
    ids = torch.as_tensor(draft_token_ids, dtype=torch.long).flatten()
    if not len(ids):
        raise FastdraftError("draft_token_ids is empty: a draft vocabulary needs at least one "
                             "token")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise FastdraftError(f"draft_token_ids must lie in [0, {vocab_size}), got "
                             f"[{int(ids.min())}, {int(ids.max())}]")
    if len(torch.unique(ids)) != len(ids):
        raise FastdraftError("draft_token_ids has repeated ids: d2t/t2d cannot express duplicates")
    return None if len(ids) == vocab_size else ids


def draft_to_target_offsets(draft_token_ids: torch.Tensor) -> torch.Tensor:
    """d2t: what the engines add to a draft index to get the target token id."""
    ids = draft_token_ids.to(torch.long)
    return ids - torch.arange(len(ids), dtype=torch.long)


def target_membership(draft_token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """t2d: which target tokens the draft vocabulary holds."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_token_ids.to(torch.long)] = True
    return t2d


def target_ids_from_offsets(d2t: torch.Tensor) -> torch.Tensor:
    """The inverse of `draft_to_target_offsets`: draft_token_ids back from d2t."""
    return d2t.to(torch.long) + torch.arange(len(d2t), dtype=torch.long)


def vocab_problems(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int,
                   expected_draft_token_ids: torch.Tensor | None = None) -> list[str]:
    """Ways d2t/t2d disagree with each other, the vocabulary or the drafter's draft ids (an
    engine reading them would put draft logits on the wrong tokens)."""
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool or d2t.dim() != 1:
        return [f"d2t must be int64 [draft_vocab] and t2d bool [vocab]; got {d2t.dtype} "
                f"{list(d2t.shape)} and {t2d.dtype} {list(t2d.shape)}"]
    problems = []
    targets = target_ids_from_offsets(d2t)
    if len(targets) and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        problems.append(f"d2t maps draft tokens outside the vocabulary [0, {vocab_size})")
        return problems
    if len(torch.unique(targets)) != len(targets):
        problems.append("d2t maps two draft tokens to the same target token")
    if int(t2d.sum()) != len(d2t):
        problems.append(f"t2d marks {int(t2d.sum())} tokens but the draft vocabulary has "
                        f"{len(d2t)}")
    elif t2d.shape == (vocab_size,) and not bool(t2d[targets].all()):
        problems.append("t2d and d2t name different target tokens")
    if expected_draft_token_ids is not None and not torch.equal(
            targets, torch.as_tensor(expected_draft_token_ids, dtype=torch.long)):
        problems.append("the target ids d2t reconstructs are not the drafter's draft_token_ids")
    return problems
