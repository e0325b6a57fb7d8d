"""Grafting one draft tree into another: how a multi-source tree is merged (spec/merged.py).

The base tree (EAGLE's, possibly with sampled children) is kept exactly as drafted. The extra
tree (the suffix drafter's chosen candidates) is walked like a trie: a node whose token is
already a child of its mapped parent is identified with that child, and only the rest is
appended, as chosen (point-mass) nodes listed after every base node. So under one parent the
sampled children stay a prefix of their draw order and the chosen ones come after them, which
verification (spec/verify.py) keeps lossless; none of it looks at the verifier's coins.
"""

from __future__ import annotations

import torch

from fastdraft.engine.spec.batch import DraftBuffers
from fastdraft.engine.spec.tree import ROOT, depths_of


def graft(base_tokens: list[int], base_parents: list[int], extra_tokens: list[int],
          extra_parents: list[int], max_new: int) -> list[tuple[int, int]]:
    """-> the (parent, token) nodes to append to the base tree (parent: a base node, ROOT or an
    earlier appended node, numbered after the base's), at most max_new of them. Extra nodes
    must list parents before children (every proposer's order); an extra node whose parent was
    dropped for lack of budget is dropped too."""
    num_base = len(base_tokens)
    child: dict[tuple[int, int], int] = {}
    for i, (tok, parent) in enumerate(zip(base_tokens, base_parents)):
        child.setdefault((parent, tok), i)
    mapped: list[int | None] = []
    new: list[tuple[int, int]] = []
    for tok, parent in zip(extra_tokens, extra_parents):
        at = ROOT if parent == ROOT else mapped[parent]
        node = None if at is None else child.get((at, tok))
        if node is None and at is not None and len(new) < max_new:
            node = num_base + len(new)
            new.append((at, tok))
            child[(at, tok)] = node
        mapped.append(node)
    return new


def graft_into(buffers: DraftBuffers, batch: int, base_width: int, width: int,
               base_parents: list[list[int]], grafts: list[list[tuple[int, int]]],
               source_id: int) -> None:
    """Appends each row's grafted nodes (from `graft`) to the step's draft buffers, whose
    first base_width columns hold the base trees. base_parents[b]: the parents of row b's real
    base nodes, as the caller grafted against them (nothing is read back from the device).
    Columns base_width..width - 1 not grafted become padding in all `batch` rows. Chosen
    nodes: is_sampled False; their parent_probs rows are never read (no sampled children)."""
    view = buffers.view(batch, width, sampled=False)
    pad = slice(base_width, width)
    view.tokens[:, pad] = 0
    view.parents[:, pad] = ROOT
    view.depths[:, pad] = 1
    view.sources[:, pad] = source_id
    view.ancestors[:, pad] = False
    view.ancestors[:, :, pad] = False
    view.ancestors[:, pad, pad] |= torch.eye(width - base_width, dtype=torch.bool,
                                             device=view.ancestors.device)
    buffers.is_sampled[:batch, pad] = False
    # One entry per grafted node: row, column, token, parent, depth; anc: (row, node, ancestor).
    rows, cols, toks, pars, deps, anc = [], [], [], [], [], []
    for b, new in enumerate(grafts):
        if not new:
            continue
        first = len(base_parents[b])
        parents = base_parents[b] + [p for p, _ in new]
        depths = depths_of(parents)
        for i in range(first, len(parents)):
            rows.append(b)
            cols.append(i)
            pars.append(parents[i])
            deps.append(depths[i])
            j = i
            while j != ROOT:          # the node and its ancestors: its tree-attention row
                anc.append((b, i, j))
                j = parents[j]
        toks += [t for _, t in new]
        view.num_nodes[b] = len(parents)
    if not rows:
        return
    dev = view.tokens.device
    index = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
    view.tokens.index_put_(index, torch.tensor(toks, device=dev))
    view.parents.index_put_(index, torch.tensor(pars, device=dev))
    view.depths.index_put_(index, torch.tensor(deps, device=dev))
    view.sources[index] = source_id
    buffers.is_sampled[index] = False
    view.ancestors[index] = False
    view.ancestors[torch.tensor(anc, device=dev).unbind(1)] = True
