"""The random draws of a decoding step, keyed by position (rng.py): a plain decode row draws its
next token from Stream.SAMPLE at that token's position, a tree row accepts with Stream.VERIFY
(per node) and Stream.BONUS at its root, whatever else runs in the same forward. A row's draws
never depend on its neighbours, on the step's kind or on its slot."""

from __future__ import annotations

import torch

from fastdraft.engine.rng import Stream, uniform_keyed
from fastdraft.engine.sampler import SamplingTensors, sample
from fastdraft.engine.spec.accept import AcceptedBatch, accept_greedy, accept_sampled
from fastdraft.engine.spec.batch import DraftBatch
from fastdraft.engine.step_io import SamplingMode


def sample_next(logits: torch.Tensor, positions: torch.Tensor, st: SamplingTensors,
                mode: SamplingMode) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain decoding: logits [B, V] of the tokens at positions [B] -> (next token, its
    logprob) [B]."""
    uniforms = None if mode is SamplingMode.GREEDY else uniform_keyed(
        st.key(Stream.SAMPLE), (positions + 1).unsqueeze(1)).squeeze(1)
    return sample(logits, st, uniforms, mode.needs_filter)


def accept_tree(drafts: DraftBatch, logits: torch.Tensor, root_pos: torch.Tensor,
                st: SamplingTensors, depth: int, mode: SamplingMode,
                stop_early: bool = False) -> AcceptedBatch:
    """Verification: each row's longest accepted path and bonus token (spec/accept.py) from
    the policy's logits [B, 1 + N, V] over [root, nodes] of rows rooted at root_pos [B]."""
    if mode is SamplingMode.GREEDY:
        return accept_greedy(drafts, logits, depth)
    nodes = torch.arange(drafts.width, device=root_pos.device)
    node_u = uniform_keyed(st.key(Stream.VERIFY), (root_pos.unsqueeze(1) << 12) + nodes)
    bonus_u = uniform_keyed(st.key(Stream.BONUS), root_pos.unsqueeze(1)).squeeze(1)
    return accept_sampled(drafts, logits, st, node_u, bonus_u, depth, mode.needs_filter,
                          stop_early=stop_early)
