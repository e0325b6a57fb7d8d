"""Verification of one draft tree against the policy's logits: the step that makes SD lossless.

Greedy: the longest path whose tokens are the policy's argmaxes, then the argmax at its last node,
so the output equals plain greedy decoding token for token.

Sampling: multi-draft recursive rejection sampling without replacement. At node u with target
p (processed exactly like plain sampling) the children are tried in tree order, each by its own
kind (one parent may have both, in a merged multi-source tree):
  - sampled children (drawn without replacement from q): accept x with min(1, p(x) / q(x)); on
    reject p <- norm(max(p - q, 0)) and q <- norm(q with x zeroed) — the next child was drawn from
    that q, and the residual has no mass on x, so dropping x from q changes nothing that matters.
  - chosen children (point masses, any choice made without looking at the verifier's coins):
    accept x with p(x); on reject p <- norm(p with x zeroed).
Whatever happens at one child, the token that u finally emits (an accepted child or the bonus
token drawn from the residual) is distributed exactly as the p u started with; by induction
the whole appended sequence is distributed as the policy's own continuation.

This module is the per-tree REFERENCE, written for clarity over plain lists; the engine runs
spec/accept.py, which does the same for a whole batch in tensor ops (tested equal token for
token from the same uniforms). Uniforms: one per node and one for the bonus token (drawn by
inverse CDF), all drawn up front, so the number of draws does not depend on the path accepted.
"""

from __future__ import annotations

import torch

from fastdraft.engine.sampler import inverse_cdf
from fastdraft.engine.sampling_params import SamplingParams
from fastdraft.engine.spec.accept import MIN_MASS as _MIN_MASS
from fastdraft.engine.spec.probs import policy_logprobs, processed_probs
from fastdraft.engine.spec.tree import Accepted, DraftTree
from fastdraft.errors import FastdraftError


def verify(tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None = None, uniforms: list[float] | None = None
           ) -> Accepted:
    """tree with N nodes, target_logits [N + 1, V] (row 0 = after the root, row i + 1 = after
    node i) -> the accepted path and one bonus token, with the policy's logprobs.
    uniforms: N + 1 values in [0, 1) (one per node, then the bonus token's); default: drawn
    from `generator` (or the global RNG)."""
    n = tree.num_nodes
    if target_logits.dim() != 2 or target_logits.shape[0] != n + 1:
        raise FastdraftError(f"target_logits must be [num_nodes + 1, V] = [{n + 1}, V], "
                             f"got {tuple(target_logits.shape)}")
    if uniforms is None:
        uniforms = _uniforms(n + 1, generator)
    if params.is_greedy:
        path, bonus = _walk_greedy(tree, target_logits)
    else:
        path, bonus = _walk_sampled(tree, target_logits, params, uniforms)
    token_ids = [int(t) for t in tree.tokens[path].tolist()] + [bonus]
    rows = torch.tensor([0] + [i + 1 for i in path], device=target_logits.device)
    logprobs = policy_logprobs(target_logits[rows], params).gather(
        -1, torch.tensor(token_ids, device=target_logits.device).unsqueeze(-1)).squeeze(-1)
    return Accepted(node_ids=path, token_ids=token_ids, logprobs=logprobs.tolist())


def _walk_greedy(tree: DraftTree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """-> (accepted node ids, bonus token): the longest path whose tokens are the argmaxes."""
    best = target_logits.argmax(dim=-1).tolist()  # [N + 1]; ties -> first max, as plain greedy
    path = argmax_path(tree.tokens.tolist(), tree.parents.tolist(), best)
    return path, best[path[-1] + 1 if path else 0]


def argmax_path(tokens: list[int], parents: list[int], best: list[int]) -> list[int]:
    """Node ids, root to leaf, of the path whose every token is the argmax after its parent
    (best[0]: after the root, best[i + 1]: after node i), taking the first matching sibling at
    each node. Proposers draft distinct siblings, so that is the longest such path. Node indices
    are topological and siblings are in order, so one pass finds it."""
    on_path = [False] * len(tokens)
    leaf, matched_parents = -1, set()
    for i, (tok, p) in enumerate(zip(tokens, parents)):
        if tok == best[p + 1] and (p < 0 or on_path[p]) and p not in matched_parents:
            on_path[i] = True
            matched_parents.add(p)
            leaf = i  # the path only grows deeper, and children come after their parents
    path = []
    while leaf >= 0:
        path.append(leaf)
        leaf = parents[leaf]
    return path[::-1]


def _walk_sampled(tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams,
                  uniforms: list[float]) -> tuple[list[int], int]:
    """-> (accepted node ids, bonus token) by recursive rejection sampling (module doc)."""
    n = tree.num_nodes
    probs = processed_probs(target_logits, params)                 # [N + 1, V]
    sampled = ([False] * n if tree.is_sampled is None
               else [bool(s) for s in tree.is_sampled.tolist()])
    q_all = None
    if any(sampled):
        if tree.parent_probs is None:
            raise FastdraftError("a tree with sampled children needs parent_probs")
        q_all = tree.parent_probs.to(device=probs.device, dtype=probs.dtype)
    # p(x) and q(x) of every node's token under its parent's *untouched* rows: the first child
    # tried at a node needs nothing else, so the common accept-first-child path stays scalar.
    idx_rows = tree.parents.to(probs.device) + 1
    idx_tok = tree.tokens.to(probs.device)
    p_first = probs[idx_rows, idx_tok].tolist() if n else []
    q_first = q_all[idx_rows, idx_tok].tolist() if (n and q_all is not None) else [0.0] * n
    path, row, residual = _rejection_walk(tree.children(), tree.tokens.tolist(), sampled,
                                          p_first, q_first, uniforms, probs, q_all)
    bonus = inverse_cdf((probs[row] if residual is None else residual).unsqueeze(0),
                        torch.tensor([uniforms[n]], dtype=torch.float64, device=probs.device))
    return path, int(bonus)


def _rejection_walk(children: list[list[int]], tokens: list[int], sampled: list[bool],
                    p_first: list[float], q_first: list[float], uniforms: list[float],
                    probs: torch.Tensor, q_all: torch.Tensor | None
                    ) -> tuple[list[int], int, torch.Tensor | None]:
    """One tree's walk from the root: at each node try its children in order until one is
    accepted (module doc). probs, q_all [N + 1, V]: p and q rows; p_first, q_first: p(x), q(x)
    of each node's token under its parent's untouched rows. -> (accepted node ids, the row the
    bonus token comes from, its residual p, or None when that row is untouched)."""
    path: list[int] = []
    row = 0
    while True:
        p: torch.Tensor | None = None    # residual target at `row`; None = untouched probs[row]
        q: torch.Tensor | None = None    # remaining draft dist at `row`; None = untouched
        accepted = None
        for c in children[row]:
            x = tokens[c]
            px = p_first[c] if p is None else float(p[x])
            if sampled[c]:
                assert q_all is not None
                qx = q_first[c] if q is None else float(q[x])
                if qx <= 0.0:
                    # Could not have been drawn from q (or is a repeat of a rejected sibling):
                    # skipping it leaves p and the later children's q exactly as if it had never
                    # been listed, which keeps the rest of the walk lossless. Accepting it with
                    # min(1, p/q) = 1 would instead emit it with probability 1.
                    continue
                if _accepts_sampled(uniforms[c], px, qx):
                    accepted = c
                    break
                p, q = _reject_sampled(probs[row] if p is None else p,
                                       q_all[row] if q is None else q, x)
            else:
                if _accepts_chosen(uniforms[c], px):
                    accepted = c
                    break
                p = _reject_chosen(probs[row] if p is None else p, x)
        if accepted is None:
            return path, row, p
        path.append(accepted)
        row = accepted + 1


def _accepts_sampled(u: float, px: float, qx: float) -> bool:
    """Accept a child drawn from q with probability min(1, p(x) / q(x)); u ~ U[0, 1), q(x) > 0."""
    return u * qx < px


def _accepts_chosen(u: float, px: float) -> bool:
    """Accept a point-mass child with probability p(x)."""
    return u < px


def _reject_sampled(p: torch.Tensor, q: torch.Tensor, x: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """p [V], q [V], rejected x -> (norm(max(p - q, 0)), norm(q with x zeroed))."""
    residual = (p - q).clamp_min_(0.0)
    mass = float(residual.sum())
    residual = residual / mass if mass > _MIN_MASS else p
    q = q.clone()
    q[x] = 0.0
    q_mass = float(q.sum())
    # No draft mass left means no later sibling can have been drawn: zeros make them all skip.
    q = q / q_mass if q_mass > _MIN_MASS else torch.zeros_like(q)
    return residual, q


def _reject_chosen(p: torch.Tensor, x: int) -> torch.Tensor:
    """p [V], rejected point mass x -> norm(p with x zeroed) (x had all the mass: keep p)."""
    out = p.clone()
    out[x] = 0.0
    mass = float(out.sum())
    return out / mass if mass > _MIN_MASS else p


def _uniforms(n: int, generator: torch.Generator | None) -> list[float]:
    device = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(n, generator=generator, device=device, dtype=torch.float64).tolist()
