"""DraftTree: what every proposer returns and what verification consumes, for ONE request.

Node i (0 <= i < num_nodes) holds a drafted token; its parent is another node or the root (-1).
The root is the request's last committed token (not yet run through the policy). Siblings are
listed in the order verification must try them (for sampled children: the order they were drawn).

Draft distributions: `parent_probs[j]` is the draft distribution q the sampled children of parent
j were taken from, with row 0 = the root and row i + 1 = node i; rows of parents that have no
sampled children are unused. A node *sampled without replacement* from its parent's q has
`is_sampled[i] = True`; verification then accepts it with min(1, p(x) / q(x)). A node that was
*chosen* (greedy top-k, a model-free suffix match) has `is_sampled[i] = False` and is verified as
a point mass (accept x with p(x)), which is lossless for any choice made without the verifier's
coins. One parent may have both (a merged multi-source tree): its sampled children, a prefix of
their draw order, then chosen ones; each rejection updates p (and, for a sampled one, q) so
that the next sibling is verified against what is left, which keeps every mix lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROOT = -1


@dataclass(frozen=True, slots=True)
class DraftTree:
    tokens: torch.Tensor                    # [N] long
    parents: torch.Tensor                   # [N] long, ROOT or an earlier node index (< i)
    parent_probs: torch.Tensor | None       # [N + 1, V] float, see module doc; None = all chosen
    is_sampled: torch.Tensor | None         # [N] bool per node; None = all chosen
    sources: torch.Tensor | None = None     # [N] int8 proposer id per node (stats)

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        assert self.parents.shape == (n,), "parents must be [N]"
        # Checked over a plain list: trees are small, verification reads the list anyway, and a
        # tensor check would need a device-matched index on every step.
        assert all(ROOT <= p < i for i, p in enumerate(self.parents.tolist())), \
            "a node's parent must be the root or an earlier node"
        if self.parent_probs is not None:
            assert self.parent_probs.shape[0] == n + 1, "parent_probs must be [N + 1, V]"
        if self.is_sampled is not None:
            assert self.is_sampled.shape == (n,), "is_sampled must be [N] (one flag per node)"

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def empty(cls) -> DraftTree:
        return cls(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), None, None)

    def depth_list(self) -> list[int]:
        """Depth of each node, 1 for children of the root (plain Python: trees are small)."""
        return depths_of(self.parents.tolist())

    def children(self) -> list[list[int]]:
        """children()[j] = node indices whose parent is j - 1 (index 0 = root), in try order."""
        return children_lists(self.parents.tolist())

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: mask[i, j] = node j is node i or one of its ancestors (tree attention)."""
        n = self.num_nodes
        rows: list[list[bool]] = []
        for i, p in enumerate(self.parents.tolist()):
            row = list(rows[p]) if p != ROOT else [False] * n
            row[i] = True
            rows.append(row)
        return torch.tensor(rows, dtype=torch.bool).view(n, n)


def depths_of(parents: list[int]) -> list[int]:
    """Parent of each node (parents before children) -> depth of each node, 1 under the root."""
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p == ROOT else depth[p] + 1)
    return depth


def children_lists(parents: list[int]) -> list[list[int]]:
    """Parent of each node -> out[j] = node indices whose parent is j - 1 (index 0 = root), in
    index order (the order verification tries siblings in)."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        out[p + 1].append(i)
    return out


@dataclass(frozen=True, slots=True)
class Accepted:
    """Result of verifying one tree: the accepted root path then one bonus token from the policy.

    node_ids: accepted node indices, root to leaf (may be empty).
    token_ids: the tokens to append: tokens of node_ids, then the bonus token (one more).
    logprobs: the policy's log-prob of each appended token, log-softmax(logits / T) (T = 1 greedy).
    """

    node_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
