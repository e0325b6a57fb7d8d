"""Where every candidate of an EAGLE-2 expansion lives, and the best-first pick of the final tree.

Expansion with `depth` levels and `k` children per expanded node has a FIXED shape: level 1 holds
the root's k children; every later level holds the k children of each of the k nodes expanded at
the level before (k * k candidates). Candidates are numbered level by level ("global index"),
children of one parent contiguously in draw order, so a parent always has a smaller index than
its children. Expanded nodes are numbered too ("scratch ids": level l's i-th expanded node is
(l - 1) * k + i), and each candidate's parent scratch id is fixed by its index alone. Only which
candidates get expanded is dynamic; everything else is precomputed here, so the proposer needs
no per-request Python.

Shapes: B requests, G candidates, S = (depth - 1) * k expanded nodes, M kept nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdraft.engine.spec.batch import DraftBatch
from fastdraft.engine.spec.tree import ROOT


@dataclass(frozen=True, slots=True)
class DraftLayout:
    depth: int
    k: int
    level_start: tuple[int, ...]        # global index of each level's first candidate
    cand_depth: torch.Tensor            # [G] long, 1 for the root's children
    cand_parent_scratch: torch.Tensor   # [G] long, scratch id of the parent (ROOT: level 1)
    scratch_level_start: torch.Tensor   # [S] long, global index of its level's first candidate
    # Constants the proposer would otherwise rebuild every step (one op each, but per step):
    scratch_eye: torch.Tensor           # [S, S] bool identity (each node attends to itself)
    scratch_cells: torch.Tensor         # [D - 1, k] long, scratch id of each level's nodes
    level_offsets: torch.Tensor         # [D - 1] long, 1 .. D - 1: expanded level l's depth
    first_order: torch.Tensor           # [1, k] long, 0 .. k - 1: level 1 expands every child
    zero_key: torch.Tensor              # [1, 1] float, the root's key

    @classmethod
    def build(cls, depth: int, k: int, device: torch.device | str = "cpu") -> DraftLayout:
        sizes = [k] + [k * k] * (depth - 1)
        starts = [sum(sizes[:i]) for i in range(depth)]
        cand_depth = torch.cat([torch.full((n,), lvl + 1) for lvl, n in enumerate(sizes)])
        parent = [torch.full((k,), ROOT)] + [
            (lvl - 1) * k + torch.arange(k * k) // k for lvl in range(1, depth)]
        scratch_level_start = torch.tensor([starts[s // k] for s in range((depth - 1) * k)],
                                           dtype=torch.long)
        num_scratch = (depth - 1) * k
        return cls(depth, k, tuple(starts), cand_depth.to(device), torch.cat(parent).to(device),
                   scratch_level_start.to(device),
                   scratch_eye=torch.eye(num_scratch, dtype=torch.bool, device=device),
                   scratch_cells=torch.arange(num_scratch, device=device).view(-1, k),
                   level_offsets=torch.arange(1, depth, device=device),
                   first_order=torch.arange(k, device=device).unsqueeze(0),
                   zero_key=torch.zeros(1, 1, device=device))

    @property
    def num_candidates(self) -> int:
        return self.cand_depth.shape[0]

    @property
    def num_scratch(self) -> int:
        return (self.depth - 1) * self.k


def select_tree(layout: DraftLayout, tokens: torch.Tensor, keys: torch.Tensor,
                expanded: torch.Tensor, scratch_ancestors: torch.Tensor, budget: int,
                source_id: int, may_pad: bool = True) -> tuple[DraftBatch, torch.Tensor]:
    """The best `budget` candidates of every row, as a DraftBatch.

    tokens, keys [B, G]: every candidate's token and key (-inf = not a real candidate);
    expanded [B, S]: global index of each scratch node; scratch_ancestors [B, S, S]: scratch
    ancestors-or-self of each scratch node. Keys never increase along a path, and ties go to the
    smaller global index, so the best-first pick (a parent before its children) is simply the
    first `budget` of a stable sort by key. Kept nodes are then listed in global order, which is
    topological and keeps siblings in draw order.
    may_pad=False promises every key is finite (greedy drafts): a few ops are then skipped.
    Returns (batch, node_scratch [B, M]: each kept node's scratch id, or -1 if not expanded).
    """
    batch, num_cand = keys.shape
    dev = keys.device
    budget = min(budget, num_cand)
    ranked = keys.sort(dim=1, descending=True, stable=True).indices[:, :budget]
    if may_pad:
        is_real = torch.isfinite(keys.gather(1, ranked))
        # Global order, padding (-inf keys) last.
        order = torch.where(is_real, ranked, ranked + num_cand).sort(dim=1).values
        is_real = order < num_cand
        sel = order.remainder(num_cand)                                           # [B, M]
        num_nodes = is_real.sum(dim=1)
    else:
        sel = ranked.sort(dim=1).values
        is_real = None
        num_nodes = torch.full((batch,), budget, dtype=torch.long, device=dev)
    scratch_of = torch.full((batch, num_cand), -1, dtype=torch.long, device=dev)
    num_scratch = expanded.shape[1]
    scratch_of.scatter_(1, expanded, torch.arange(num_scratch, device=dev).expand(batch, -1))
    node_scratch = scratch_of.gather(1, sel)
    if is_real is not None:
        node_scratch = torch.where(is_real, node_scratch, -1)
    parent_scratch = layout.cand_parent_scratch[sel]                              # [B, M]
    # Parent node index: where the parent's global index sits among the kept nodes.
    position = torch.full((batch, num_cand), ROOT, dtype=torch.long, device=dev)
    position.scatter_(1, sel, torch.arange(budget, device=dev).expand(batch, -1))
    eye = torch.eye(budget, dtype=torch.bool, device=dev)
    if not num_scratch:  # depth 1: every node is a child of the root
        parents = torch.full((batch, budget), ROOT, dtype=torch.long, device=dev)
        ancestors = eye.expand(batch, -1, -1)
    else:
        parent_global = expanded.gather(1, parent_scratch.clamp_min(0))
        has_parent = parent_scratch >= 0
        if is_real is not None:
            has_parent &= is_real
        parents = torch.where(has_parent, position.gather(1, parent_global), ROOT)
        # Node j is a strict ancestor of node i iff j was expanded and its scratch id is among
        # the scratch ancestors-or-self of i's parent.
        parent_anc = scratch_ancestors.gather(
            1, parent_scratch.clamp_min(0).unsqueeze(-1).expand(-1, -1, num_scratch))
        parent_anc &= has_parent.unsqueeze(-1)                                    # [B, M, S]
        strict = parent_anc.gather(2, node_scratch.clamp_min(0).unsqueeze(1).expand(
            -1, budget, -1)) & (node_scratch >= 0).unsqueeze(1)
        ancestors = strict | eye
    node_tokens, depths = tokens.gather(1, sel), layout.cand_depth[sel]
    if is_real is not None:
        node_tokens = torch.where(is_real, node_tokens, 0)
        depths = torch.where(is_real, depths, 1)
    drafts = DraftBatch(
        tokens=node_tokens,
        parents=parents,
        depths=depths,
        ancestors=ancestors,
        num_nodes=num_nodes,
        parent_probs=None, is_sampled=None,
        sources=torch.full((batch, budget), source_id, dtype=torch.int8, device=dev))
    return drafts, node_scratch
