"""DraftBatch: the draft trees of every running request, padded into batch tensors.

A vectorised proposer builds this directly (no per-request Python); the policy's verify forward
reads it as is (ids, positions and the tree mask come from whole-batch tensor ops), and
acceptance (spec/accept.py) runs on it in batch ops, inside the step's graph. Row b holds
`num_nodes[b]` real nodes first, then padding: token 0, parent ROOT, depth 1, attending only to
itself. Padding is computed by the verify forward like any node, but it is never part of a tree:
`tree(b)` and every acceptance rule see only the real nodes.

DraftBuffers holds the step's static copy (graph inputs and outputs live at fixed addresses).
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
    num_nodes: torch.Tensor             # [B] long: real nodes per row (a prefix of the N)
    parent_probs: torch.Tensor | None   # [B, N + 1, V] (DraftTree.parent_probs per row) or None
    is_sampled: torch.Tensor | None     # [B, N] bool per node or None (= all chosen)
    sources: torch.Tensor               # [B, N] int8 proposer id per node

    @property
    def width(self) -> int:
        """N: nodes per row including padding."""
        return self.tokens.shape[1]

    def tree(self, b: int) -> DraftTree:
        """Row b as a DraftTree (real nodes only): what the per-request verify rule reads."""
        n = int(self.num_nodes[b])
        return DraftTree(self.tokens[b, :n], self.parents[b, :n],
                         None if self.parent_probs is None else self.parent_probs[b, : n + 1],
                         None if self.is_sampled is None else self.is_sampled[b, :n],
                         self.sources[b, :n])

    @classmethod
    def empty(cls, batch_size: int, device: torch.device | str = "cpu") -> DraftBatch:
        z = torch.zeros(batch_size, 0, dtype=torch.long, device=device)
        return cls(z, z, z, torch.zeros(batch_size, 0, 0, dtype=torch.bool, device=device),
                   torch.zeros(batch_size, dtype=torch.long, device=device), None, None,
                   z.to(torch.int8))

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
        sampled = torch.zeros(batch, width, dtype=torch.bool) if any_sampled else None
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
                sampled[b, :n] = tree.is_sampled.cpu()
        return cls(tokens.to(device), parents.to(device), depths.to(device),
                   ancestors.to(device),
                   torch.tensor([t.num_nodes for t in trees], device=device),
                   None if probs is None else probs.to(device),
                   None if sampled is None else sampled.to(device), sources.to(device))


class DraftBuffers:
    """Max-size static tensors that hold one step's draft trees: [max_batch, max_nodes] (+ the
    draft probabilities [max_batch, max_nodes + 1, vocab] once a sampled tree is drafted)."""

    def __init__(self, max_batch: int, max_nodes: int, vocab_size: int,
                 device: torch.device) -> None:
        b, n = max_batch, max_nodes
        self.vocab_size, self.device = vocab_size, device
        self.tokens = torch.zeros(b, n, dtype=torch.long, device=device)
        self.parents = torch.full((b, n), ROOT, dtype=torch.long, device=device)
        self.depths = torch.ones(b, n, dtype=torch.long, device=device)
        self.ancestors = torch.eye(n, dtype=torch.bool, device=device).repeat(b, 1, 1)
        self.num_nodes = torch.zeros(b, dtype=torch.long, device=device)
        self.sources = torch.zeros(b, n, dtype=torch.int8, device=device)
        self.is_sampled = torch.zeros(b, n, dtype=torch.bool, device=device)
        self._parent_probs: torch.Tensor | None = None  # allocated on the first sampled tree

    def parent_probs(self) -> torch.Tensor:
        if self._parent_probs is None:
            b, n = self.tokens.shape
            self._parent_probs = torch.zeros(b, n + 1, self.vocab_size, device=self.device)
        return self._parent_probs

    def view(self, batch: int, width: int, sampled: bool) -> DraftBatch:
        """The first `batch` rows, `width` nodes each; sampled: with q and is_sampled."""
        return DraftBatch(self.tokens[:batch, :width], self.parents[:batch, :width],
                          self.depths[:batch, :width], self.ancestors[:batch, :width, :width],
                          self.num_nodes[:batch],
                          self.parent_probs()[:batch, : width + 1] if sampled else None,
                          self.is_sampled[:batch, :width] if sampled else None,
                          self.sources[:batch, :width])

    def store(self, drafts: DraftBatch, batch: int, width: int) -> DraftBatch:
        """Copies drafts (<= batch rows, <= width nodes, any device) into the buffers, padding
        rows and nodes; returns the view the verify step reads. Inside a captured stage this is
        a handful of device copies."""
        rows, num = drafts.tokens.shape
        sampled = drafts.parent_probs is not None
        out = self.view(batch, width, sampled)
        pad = (slice(rows, batch), slice(None))
        out.tokens[:rows, :num] = drafts.tokens
        out.parents[:rows, :num] = drafts.parents
        out.depths[:rows, :num] = drafts.depths
        out.sources[:rows, :num] = drafts.sources
        out.num_nodes[:rows] = drafts.num_nodes
        out.tokens[:, num:] = 0
        out.parents[:, num:] = ROOT
        out.depths[:, num:] = 1
        out.ancestors.copy_(torch.eye(width, dtype=torch.bool, device=self.device))
        out.ancestors[:rows, :num, :num] = drafts.ancestors
        out.num_nodes[pad[0]] = 0
        if sampled:
            out.parent_probs[:rows, : num + 1] = drafts.parent_probs
            out.is_sampled[:rows, :num] = drafts.is_sampled
            out.is_sampled[:, num:] = False
            out.is_sampled[pad] = False
        return out
