"""Grafting a suffix tree into EAGLE's: trie identification, the budget, and the batch buffers
written exactly as DraftBatch.from_trees would write the merged trees."""

from __future__ import annotations

import random

import torch

from fastdraft.engine.spec.batch import DraftBatch, DraftBuffers
from fastdraft.engine.spec.graft import graft, graft_into
from fastdraft.engine.spec.tree import ROOT, DraftTree
from tests.engine.spec.test_verify import random_tree


def test_graft_follows_matching_tokens_and_appends_the_rest() -> None:
    # base: root -> 5 -> 6, root -> 7; extra: 5 -> 6 -> 9 (shares two nodes), 5 -> 8, 4
    new = graft([5, 6, 7], [ROOT, 0, ROOT], [5, 6, 9, 8, 4], [ROOT, 0, 1, 0, ROOT], max_new=5)
    assert new == [(1, 9), (0, 8), (ROOT, 4)]


def test_graft_budget_drops_the_children_of_dropped_nodes() -> None:
    # extra: 1 -> 2 -> 3 and 4 -> 5; budget 2: 1 and 2 fit, 3 and 4 do not, so 5 (under 4) goes
    new = graft([], [], [1, 2, 4, 3, 5], [ROOT, 0, ROOT, 1, 2], max_new=2)
    assert new == [(ROOT, 1), (0, 2)]
    chained = graft([9], [ROOT], [1, 2], [ROOT, 0], max_new=2)
    assert chained == [(ROOT, 1), (1, 2)]   # the second hangs under the first appended node


def _merged(base: DraftTree, new: list[tuple[int, int]]) -> DraftTree:
    tokens = base.tokens.tolist() + [t for _, t in new]
    parents = base.parents.tolist() + [p for p, _ in new]
    sampled = base.is_sampled.tolist() + [False] * len(new)
    sources = base.sources.tolist() + [1] * len(new)
    return DraftTree(torch.tensor(tokens, dtype=torch.long),
                     torch.tensor(parents, dtype=torch.long), None,
                     torch.tensor(sampled, dtype=torch.bool), torch.tensor(sources,
                                                                           dtype=torch.int8))


def test_graft_into_buffers_equals_the_merged_trees_padded() -> None:
    rng = random.Random(0)
    batch, base_width, share, vocab = 4, 6, 3, 7
    width = base_width + share
    buffers = DraftBuffers(6, 12, vocab, torch.device("cpu"))
    # Stale contents from an earlier, wider step must not leak into the new one.
    buffers.store(DraftBatch.from_trees([random_tree(rng, 12, vocab) for _ in range(6)]), 6, 12)
    bases, grafts = [], []
    for b in range(batch):
        shape = random_tree(rng, rng.randint(0, base_width), vocab)
        n = shape.num_nodes
        base = DraftTree(shape.tokens, shape.parents, None, torch.ones(n, dtype=torch.bool),
                         torch.zeros(n, dtype=torch.int8))
        extra = random_tree(rng, 6, vocab)
        bases.append(base)
        grafts.append([] if b == 2 else graft(base.tokens.tolist(), base.parents.tolist(),
                                              extra.tokens.tolist(), extra.parents.tolist(),
                                              share))
    stored = DraftBatch.from_trees(bases)
    stored = DraftBatch(stored.tokens, stored.parents, stored.depths, stored.ancestors,
                        stored.num_nodes, torch.zeros(batch, stored.width + 1, vocab),
                        torch.ones(batch, stored.width, dtype=torch.bool), stored.sources)
    buffers.store(stored, batch, base_width)
    graft_into(buffers, batch, base_width, width, [t.parents.tolist() for t in bases], grafts,
               source_id=1)
    got = buffers.view(batch, width, sampled=True)
    want = DraftBatch.from_trees([_merged(t, g) for t, g in zip(bases, grafts)])
    assert any(grafts) and want.width <= width
    n = want.width
    for name in ("tokens", "parents", "depths"):
        assert torch.equal(getattr(got, name)[:, :n], getattr(want, name)), name
    assert torch.equal(got.num_nodes, want.num_nodes)
    assert torch.equal(got.ancestors[:, :n, :n], want.ancestors)
    real = torch.arange(width) < got.num_nodes.unsqueeze(1)
    assert torch.equal(got.sources[:, :n][real[:, :n]], want.sources[real[:, :n]])
    assert torch.equal(got.is_sampled[:, :n] & real[:, :n], want.is_sampled & real[:, :n])
    # Columns past each row's nodes are padding: token 0, parent ROOT, depth 1, only itself.
    pad = ~real
    assert (got.tokens[pad] == 0).all() and (got.parents[pad] == ROOT).all()
    assert (got.depths[pad] == 1).all()
    eye = torch.eye(width, dtype=torch.bool).expand(batch, -1, -1)
    assert torch.equal(got.ancestors[pad], eye[pad])
    assert not (got.ancestors & pad.unsqueeze(1) & ~eye).any()
