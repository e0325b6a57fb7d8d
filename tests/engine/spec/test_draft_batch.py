"""The batched draft-tree path against slow per-tree references: padding round trips, the static
buffers a step's trees live in, the static EAGLE-2 candidate layout and the vectorised
best-first pick (batched verification: tests/engine/spec/test_accept.py)."""

from __future__ import annotations

import heapq
import random

import pytest
import torch

from fastdraft.engine.spec.batch import DraftBatch, DraftBuffers
from fastdraft.engine.spec.draft_layout import DraftLayout, select_tree
from fastdraft.engine.spec.tree import ROOT, DraftTree


def random_tree(rng: random.Random, num_nodes: int, vocab: int) -> DraftTree:
    """A random tree whose siblings carry distinct tokens (as every proposer's do)."""
    tokens, parents, used = [], [], {}
    for i in range(num_nodes):
        parent = rng.choice([p for p in range(-1, i) if len(used.get(p, ())) < vocab])
        tok = rng.choice([t for t in range(vocab) if t not in used.get(parent, set())])
        used.setdefault(parent, set()).add(tok)
        tokens.append(tok)
        parents.append(parent)
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents), None, None)


def assert_rows_hold(batch: DraftBatch, trees: list[DraftTree]) -> None:
    """Row b of the batch is trees[b]; its padding attends only to itself, off the root."""
    width = batch.width
    for b, tree in enumerate(trees):
        back = batch.tree(b)
        assert back.tokens.tolist() == tree.tokens.tolist()
        assert back.parents.tolist() == tree.parents.tolist()
        n = tree.num_nodes
        assert batch.depths[b, :n].tolist() == tree.depth_list()
        assert torch.equal(batch.ancestors[b, :n, :n], tree.ancestor_mask())
        assert torch.equal(batch.ancestors[b, n:, n:], torch.eye(width - n, dtype=torch.bool))
        assert not batch.ancestors[b, n:, :n].any()
        assert (batch.parents[b, n:] == ROOT).all()


def test_from_trees_round_trips_and_pads_with_self_only_nodes() -> None:
    rng = random.Random(0)
    trees = [random_tree(rng, n, 6) for n in (3, 0, 5)]
    batch = DraftBatch.from_trees(trees)
    assert batch.width == 5 and batch.num_nodes.tolist() == [3, 0, 5]
    assert_rows_hold(batch, trees)


def test_buffers_store_pads_rows_and_nodes_and_round_trips() -> None:
    rng = random.Random(1)
    buffers = DraftBuffers(max_batch=4, max_nodes=6, vocab_size=5, device=torch.device("cpu"))
    for trees in ([random_tree(rng, n, 5) for n in (4, 6)], [random_tree(rng, 2, 5)]):
        view = buffers.store(DraftBatch.from_trees(trees), batch=3, width=6)
        assert view.tokens.shape == (3, 6) and view.num_nodes.tolist()[2] == 0
        assert_rows_hold(view, trees)
        assert view.parent_probs is None


def test_layout_numbers_levels_and_parents() -> None:
    layout = DraftLayout.build(depth=3, k=2)
    assert layout.level_start == (0, 2, 6)
    assert layout.num_candidates == 10 and layout.num_scratch == 4
    assert layout.cand_depth.tolist() == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    # Level 2: children of scratch 0 then 1; level 3: of scratch 2 then 3.
    assert layout.cand_parent_scratch.tolist() == [ROOT, ROOT, 0, 0, 1, 1, 2, 2, 3, 3]


def random_expansion(rng: random.Random, depth: int, k: int, vocab: int):
    """An expansion as the proposer builds it: monotone keys (children <= parent), ties possible,
    the top-k of each level expanded. Returns (layout, tokens, keys, expanded, scratch_ancestors,
    per-candidate parent global index)."""
    layout = DraftLayout.build(depth, k)
    tokens, keys, parent_of = [], [], []
    expanded, scratch_parent = [], []
    level_keys = [0.0]
    level_globals = [ROOT]
    for level in range(depth):
        start = layout.level_start[level]
        # Frontier of the previous level (root for level 1): its top-k by key, ties by index.
        if level == 0:
            frontier = [(ROOT, 0.0)]
        else:
            ranked = sorted(range(len(level_keys)), key=lambda i: (-level_keys[i], i))[:k]
            frontier = [(level_globals[i], level_keys[i]) for i in ranked]
            for g, _ in frontier:
                expanded.append(g)
                scratch_parent.append(g)
        new_keys, new_globals = [], []
        for f_index, (g, key) in enumerate(frontier):
            toks = rng.sample(range(vocab), k)
            drops = sorted(rng.choice([0.0, 0.0, rng.random()]) for _ in range(k))
            for c in range(k):
                tokens.append(toks[c])
                child_key = key - drops[c] if rng.random() > 0.1 else float("-inf")
                keys.append(child_key if key != float("-inf") else float("-inf"))
                parent_of.append(g)
                new_keys.append(keys[-1])
                new_globals.append(start + f_index * k + c)
        level_keys, level_globals = new_keys, new_globals
    num_scratch = len(expanded)
    scratch_of = {g: s for s, g in enumerate(expanded)}
    anc = torch.zeros(num_scratch, num_scratch, dtype=torch.bool)
    for s, g in enumerate(expanded):
        chain = g
        while chain != ROOT:
            anc[s, scratch_of[chain]] = True
            chain = parent_of[chain]
    return (layout, torch.tensor([tokens]), torch.tensor([keys]), torch.tensor([expanded]),
            anc.unsqueeze(0), parent_of)


def best_first(keys: list[float], parent_of: list[int], budget: int) -> list[int]:
    """Reference: pop the best available candidate (ties: smaller index), push its children."""
    children: dict[int, list[int]] = {}
    for g, p in enumerate(parent_of):
        children.setdefault(p, []).append(g)
    heap = [(-keys[g], g) for g in children.get(ROOT, []) if keys[g] != float("-inf")]
    heapq.heapify(heap)
    out = []
    while heap and len(out) < budget:
        _, g = heapq.heappop(heap)
        out.append(g)
        for c in children.get(g, []):
            if keys[c] != float("-inf"):
                heapq.heappush(heap, (-keys[c], c))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_select_tree_is_the_best_first_tree(seed) -> None:
    rng = random.Random(seed)
    depth, k, vocab = rng.randint(1, 5), rng.randint(1, 4), 12
    budget = rng.randint(1, 20)
    layout, tokens, keys, expanded, anc, parent_of = random_expansion(rng, depth, k, vocab)
    drafts, node_scratch = select_tree(layout, tokens, keys, expanded, anc, budget, source_id=0)
    want = sorted(best_first(keys[0].tolist(), parent_of, budget))  # global order
    n = drafts.num_nodes[0]
    assert n == len(want)
    tree = drafts.tree(0)
    assert tree.tokens.tolist() == [tokens[0, g].item() for g in want]
    assert tree.parents.tolist() == [ROOT if parent_of[g] == ROOT else want.index(parent_of[g])
                                     for g in want]
    assert drafts.depths[0, :n].tolist() == tree.depth_list()
    assert torch.equal(drafts.ancestors[0, :n, :n], tree.ancestor_mask())
    scratch_of = {g: s for s, g in enumerate(expanded[0].tolist())}
    assert node_scratch[0, :n].tolist() == [scratch_of.get(g, -1) for g in want]
