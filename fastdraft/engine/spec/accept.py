"""Verification of a whole batch of draft trees in tensor ops, with no host sync: what runs
inside a speculative step (and its CUDA graph). `verify.verify` is the per-tree reference these
functions equal token for token (tests/engine/spec/test_accept.py).

Greedy (`accept_greedy`): per row the longest path whose tokens are the policy's argmaxes, then
the argmax after it; one small loop over depth. Sampled (`accept_sampled`, any mix of greedy,
sampled and filtered rows): recursive rejection sampling walked for every row at once. Each
iteration tries one candidate child per row (the next sibling after a rejection, the first
child after an acceptance), so `width` iterations visit every node a walk can reach. Uniforms
come in drawn up front (one per node, one for the bonus token), from counters (engine/rng.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdraft.engine.sampler import SamplingTensors, inverse_cdf, sample_greedy
from fastdraft.engine.spec.batch import DraftBatch

# A residual whose mass is below this is rounding noise of p ~= q (rejection then had
# probability ~0); dividing by it would amplify noise into a distribution, so keep p instead.
MIN_MASS = 1e-12


@dataclass(frozen=True, slots=True)
class AcceptedBatch:
    """path [B, D]: accepted node ids root to leaf, -1 past num_accepted [B]; token_ids and
    logprobs [B, D + 1]: the path's tokens then the bonus token at index num_accepted (0 after),
    with the policy's log-softmax(logits / T) (T = 1 for greedy rows)."""

    path: torch.Tensor
    num_accepted: torch.Tensor
    token_ids: torch.Tensor
    logprobs: torch.Tensor


def tree_links(parents: torch.Tensor, num_nodes: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """parents [B, N], num_nodes [B] -> (first_child [B, N + 1]: first real child of row r (0 =
    the root, r = node r - 1), next_sibling [B, N]: the next real node with the same parent;
    -1 = none). Siblings come in index order: the order verification tries them."""
    width = parents.shape[1]
    idx = torch.arange(width, device=parents.device)
    real = idx < num_nodes.unsqueeze(1)                                           # [B, N]
    rows = torch.arange(width + 1, device=parents.device)
    is_child = ((parents + 1).unsqueeze(1) == rows.view(1, -1, 1)) & real.unsqueeze(1)
    first_child = _first_true(is_child)                                           # [B, N + 1]
    later_sibling = ((parents.unsqueeze(2) == parents.unsqueeze(1)) & real.unsqueeze(1)
                     & (idx.view(1, 1, -1) > idx.view(1, -1, 1)))
    return first_child, _first_true(later_sibling)


def _first_true(mask: torch.Tensor) -> torch.Tensor:
    """[..., N] bool -> index of the first True along the last dim, -1 where none."""
    width = mask.shape[-1]
    if not width:
        return torch.full(mask.shape[:-1], -1, dtype=torch.long, device=mask.device)
    first = torch.where(mask, torch.arange(width, device=mask.device), width).amin(-1)
    return torch.where(first < width, first, -1)


def accept_greedy(drafts: DraftBatch, logits: torch.Tensor, max_depth: int) -> AcceptedBatch:
    """drafts with N nodes per row, logits [B, 1 + N, V] -> the longest argmax path (first
    matching sibling at each node) and the argmax after it, per row. No loop over depth: a
    node is on the path iff every node from the root to it matches the argmax after its
    parent and is the first matching sibling (tree ancestors are in `drafts.ancestors`)."""
    batch, width = drafts.tokens.shape
    dev = logits.device
    best, best_logprob = sample_greedy(logits.flatten(0, 1))   # plain greedy's own pick
    best, best_logprob = best.view(batch, width + 1), best_logprob.view(batch, width + 1)
    idx = torch.arange(width, device=dev)
    real = idx < drafts.num_nodes.unsqueeze(1)
    matches = (drafts.tokens == best.gather(1, drafts.parents + 1)) & real       # [B, N]
    earlier_match = ((drafts.parents.unsqueeze(2) == drafts.parents.unsqueeze(1))
                     & (idx.view(1, 1, -1) < idx.view(1, -1, 1)) & matches.unsqueeze(1))
    good = matches & ~earlier_match.any(-1)
    on_path = real & ~(drafts.ancestors & ~good.unsqueeze(1)).any(-1)           # [B, N]
    num_accepted = on_path.sum(1)
    levels = torch.arange(1, max_depth + 1, device=dev).view(1, -1, 1)
    path = _first_true(on_path.unsqueeze(1) & (drafts.depths.unsqueeze(1) == levels))
    # The token after each row is its argmax: path tokens, then the bonus.
    rows = torch.cat([torch.zeros(batch, 1, dtype=torch.long, device=dev),
                      (path + 1).clamp_min(0)], 1)
    cols = torch.arange(max_depth + 1, device=dev)
    valid = cols.unsqueeze(0) <= num_accepted.unsqueeze(1)
    token_ids = torch.where(valid, best.gather(1, rows), 0)
    logprobs = torch.where(valid, best_logprob.gather(1, rows), 0.0)
    return AcceptedBatch(path, num_accepted, token_ids, logprobs)


def accept_sampled(drafts: DraftBatch, logits: torch.Tensor, st: SamplingTensors,
                   node_uniforms: torch.Tensor, bonus_uniforms: torch.Tensor, max_depth: int,
                   needs_filter: bool = True, stop_early: bool = False) -> AcceptedBatch:
    """Any mix of rows: drafts with N nodes per row, logits [B, 1 + N, V], the rows' sampling
    settings, node_uniforms [B, N] and bonus_uniforms [B] in [0, 1) -> recursive rejection
    sampling per row (sampled children: min(1, p/q) and the residual; chosen children: p(x)
    and p without x; greedy rows: p is the one-hot argmax, which makes this the argmax path).

    The walk state is pq [B, 2, V]: the current p and q of every row, updated together; what
    each iteration needs of its candidate node comes from one gather of a per-node table.
    stop_early: leave the loop once every row's walk has ended. That reads a flag on the host
    each iteration, so only eager CPU steps use it (there is no device to wait for); captured
    graphs always run all `width` iterations (the extra ones change nothing)."""
    batch, width = drafts.tokens.shape
    dev = logits.device
    scaled, filtered = st.scale_and_filter(logits, needs_filter)                # [B, 1 + N, V]
    probs = filtered.softmax(-1)
    one_hot = torch.zeros_like(probs).scatter_(-1, scaled.argmax(-1, keepdim=True), 1.0)
    probs = torch.where(st.is_greedy.view(-1, 1, 1), one_hot, probs)
    q_all = (torch.zeros_like(probs) if drafts.parent_probs is None
             else drafts.parent_probs.to(probs.dtype))
    pq_rows = torch.stack([probs, q_all], 2)                                  # [B, 1 + N, 2, V]
    first_child, next_sibling = tree_links(drafts.parents, drafts.num_nodes)
    # Per node: its token, uniform, whether it was drawn from its parent's q (a greedy row
    # verifies every child as a point mass), its first child and next sibling.
    sampled = (torch.zeros(batch, width, dtype=torch.bool, device=dev)
               if drafts.is_sampled is None else drafts.is_sampled & ~st.is_greedy.unsqueeze(1))
    table = torch.stack([drafts.tokens.double(), node_uniforms.double(), sampled.double(),
                         first_child[:, 1:].double(), next_sibling.double()], 2)  # [B, N, 5]
    b_idx = torch.arange(batch, device=dev)
    cand = first_child[:, 0]
    pq = pq_rows[:, 0]
    # Rows of pq kept as p, q -> 0. Filled on the device: a host list would be a copy to the
    # GPU, which a CUDA graph capture refuses (tests/engine/test_static_steps.py counts them).
    keep_p = torch.zeros(1, 2, 1, device=dev)
    keep_p[:, 0] = 1.0
    path = torch.full((batch, max_depth), -1, dtype=torch.long, device=dev)
    depth_cols = torch.arange(max_depth, device=dev)
    num_accepted = torch.zeros(batch, dtype=torch.long, device=dev)
    for _ in range(width):
        live = cand >= 0
        if stop_early and not bool(live.any()):
            break
        c = cand.clamp_min(0)
        tok, u, is_s, child, sibling = table.gather(
            1, c.view(-1, 1, 1).expand(-1, 1, 5)).squeeze(1).unbind(1)
        x = tok.long().view(-1, 1, 1).expand(-1, 2, 1)
        px, qx = pq.gather(2, x).squeeze(2).unbind(1)
        is_s = is_s > 0.5
        # A sampled child q could not have drawn (or a repeat of a rejected sibling) is skipped:
        # p and q stay as if it had never been listed.
        tried = live & ~(is_s & (qx <= 0))
        accepted = tried & (torch.where(is_s, u * qx, u) < px)
        rejected = tried & ~accepted
        pq_rej = _reject_rows(pq, x, is_s, keep_p)
        pq = torch.where(accepted.view(-1, 1, 1), pq_rows[b_idx, c + 1],
                         torch.where(rejected.view(-1, 1, 1), pq_rej, pq))
        path = torch.where(accepted.unsqueeze(1) & (depth_cols == num_accepted.unsqueeze(1)),
                           c.unsqueeze(1), path)
        num_accepted += accepted
        cand = torch.where(accepted, child.long(), torch.where(live, sibling.long(), cand))
    bonus = inverse_cdf(pq[:, 0], bonus_uniforms)
    path_tokens = drafts.tokens.gather(1, path.clamp_min(0)) if width else \
        torch.zeros(batch, max_depth, dtype=torch.long, device=dev)
    return _assemble_sampled(path, num_accepted, path_tokens, bonus, scaled.log_softmax(-1))


def _assemble_sampled(path: torch.Tensor, num_accepted: torch.Tensor, path_tokens: torch.Tensor,
                      bonus: torch.Tensor, logprob_table: torch.Tensor) -> AcceptedBatch:
    batch, depth = path.shape
    cols = torch.arange(depth + 1, device=path.device).unsqueeze(0)
    token_ids = torch.cat([path_tokens, bonus.unsqueeze(1)], 1)
    token_ids = torch.where(cols == num_accepted.unsqueeze(1), bonus.unsqueeze(1), token_ids)
    valid = cols <= num_accepted.unsqueeze(1)
    token_ids = torch.where(valid, token_ids, 0)
    rows = torch.cat([torch.zeros(batch, 1, dtype=torch.long, device=path.device),
                      (path + 1).clamp_min(0)], 1)                                 # [B, D + 1]
    per_row = logprob_table.gather(1, rows.unsqueeze(2).expand(-1, -1, logprob_table.shape[2]))
    logprobs = per_row.gather(2, token_ids.unsqueeze(2)).squeeze(2)
    return AcceptedBatch(path, num_accepted, token_ids, torch.where(valid, logprobs, 0.0))


def _reject_rows(pq: torch.Tensor, x: torch.Tensor, sampled: torch.Tensor,
                 keep_p: torch.Tensor) -> torch.Tensor:
    """pq [B, 2, V] (p, q), rejected tokens x [B, 2, 1], sampled [B] -> pq after the rejection:
    sampled child: (norm(max(p - q, 0)), norm(q without x)); chosen child: (norm(p without x),
    q). A residual below MIN_MASS keeps p; no q mass left makes q zeros (later siblings then
    cannot have been drawn and are skipped)."""
    p, q = pq.unbind(1)
    residual = (p - q).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    p_sampled = torch.where(mass > MIN_MASS, residual / mass.clamp_min(MIN_MASS), p)
    dropped = pq.scatter(2, x, 0.0)                                      # p and q without x
    masses = dropped.sum(-1, keepdim=True)
    # p without x renormalised (or p), q without x renormalised (or zeros)
    p_chosen_q_sampled = torch.where(masses > MIN_MASS, dropped / masses.clamp_min(MIN_MASS),
                                     pq * keep_p)
    sampled_rows = torch.stack([p_sampled, p_chosen_q_sampled[:, 1]], 1)
    chosen_rows = torch.stack([p_chosen_q_sampled[:, 0], q], 1)
    return torch.where(sampled.view(-1, 1, 1), sampled_rows, chosen_rows)
