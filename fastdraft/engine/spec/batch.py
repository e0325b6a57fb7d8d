"""DraftBatch: the draft trees of every running request, padded into batch tensors.

A vectorised proposer builds this directly (no per-request Python); the policy's verify forward
reads it as is (ids, positions and the tree mask come from whole-batch tensor ops), and greedy
acceptance runs on it in a few batch ops. Row b holds `num_nodes[b]` real nodes first, then
padding: token 0, parent ROOT, depth 1, attending only to itself. Padding is computed by the
verify forward like any node, but it is never part of a tree: `tree(b)` and every acceptance rule
see only the real nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdraft.engine.spec.tree import ROOT, DraftTree


@dataclass(frozen=True, slots=True)
class DraftBatch:
    tokens: torch.Tensor                # [B, N] long
    parents: torch.Tensor               # [B, N] long: ROOT or an earlier node of the same row
    depths: torch.Tensor                # [B, N] long: 1 for children of the root
    ancestors: torch.Tensor             # [B, N, N] bool: [b, i, j] = node j is i or i's ancestor
    num_nodes: list[int]                # real nodes per row (a prefix of the N columns)
    parent_probs: torch.Tensor | None   # [B, N + 1, V] (DraftTree.parent_probs per row) or None
    is_sampled: torch.Tensor | None     # [B, N + 1] bool or None (= all chosen)
    sources: torch.Tensor               # [B, N] int8 proposer id per node

    @property
    def width(self) -> int:
        """N: nodes per row including padding."""
        return self.tokens.shape[1]

    def tree(self, b: int) -> DraftTree:
        """Row b as a DraftTree (real nodes only): what the per-request verify rule reads."""
        n = self.num_nodes[b]
        return DraftTree(self.tokens[b, :n], self.parents[b, :n],
                         None if self.parent_probs is None else self.parent_probs[b, : n + 1],
                         None if self.is_sampled is None else self.is_sampled[b, : n + 1],
                         self.sources[b, :n])

    @classmethod
    def empty(cls, batch_size: int, device: torch.device | str = "cpu") -> DraftBatch:
        z = torch.zeros(batch_size, 0, dtype=torch.long, device=device)
        return cls(z, z, z, torch.zeros(batch_size, 0, 0, dtype=torch.bool, device=device),
                   [0] * batch_size, None, None, z.to(torch.int8))

    @classmethod
    def from_trees(cls, trees: list[DraftTree], device: torch.device | str = "cpu",
                   source_id: int = 0) -> DraftBatch:
        """Pads per-request trees (model-free proposers build those) into one batch."""
        batch, width = len(trees), max((t.num_nodes for t in trees), default=0)
        tokens = torch.zeros(batch, width, dtype=torch.long)
        parents = torch.full((batch, width), ROOT, dtype=torch.long)
        depths = torch.ones(batch, width, dtype=torch.long)
        ancestors = torch.eye(width, dtype=torch.bool).repeat(batch, 1, 1)
        sources = torch.full((batch, width), source_id, dtype=torch.int8)
        any_probs = any(t.parent_probs is not None for t in trees)
        vocab = next((t.parent_probs.shape[-1] for t in trees if t.parent_probs is not None), 0)
        probs = torch.zeros(batch, width + 1, vocab) if any_probs else None
        any_sampled = any(t.is_sampled is not None for t in trees)
        sampled = torch.zeros(batch, width + 1, dtype=torch.bool) if any_sampled else None
        for b, tree in enumerate(trees):
            n = tree.num_nodes
            if not n:
                continue
            tokens[b, :n] = tree.tokens.cpu()
            parents[b, :n] = tree.parents.cpu()
            depths[b, :n] = torch.tensor(tree.depth_list())
            ancestors[b, :n, :n] = tree.ancestor_mask()
            if tree.sources is not None:
                sources[b, :n] = tree.sources.cpu()
            if probs is not None and tree.parent_probs is not None:
                probs[b, : n + 1] = tree.parent_probs.cpu()
            if sampled is not None and tree.is_sampled is not None:
                sampled[b, : n + 1] = tree.is_sampled.cpu()
        return cls(tokens.to(device), parents.to(device), depths.to(device),
                   ancestors.to(device), [t.num_nodes for t in trees],
                   None if probs is None else probs.to(device),
                   None if sampled is None else sampled.to(device), sources.to(device))
