"""The batched draft-tree path against slow per-tree references: padding round trips, the static
EAGLE-2 candidate layout, the vectorised best-first pick, and batched greedy and sampled
verification."""

from __future__ import annotations

import heapq
import random

import pytest
import torch

from fastdraft.engine.sampling_params import SamplingParams
from fastdraft.engine.spec.batch import DraftBatch
from fastdraft.engine.spec.draft_layout import DraftLayout, select_tree
from fastdraft.engine.spec.tree import ROOT, DraftTree
from fastdraft.engine.spec.verify import verify, verify_batch, verify_greedy_batch

GREEDY = SamplingParams(greedy=True)


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


def test_from_trees_round_trips_and_pads_with_self_only_nodes() -> None:
    rng = random.Random(0)
    trees = [random_tree(rng, n, 6) for n in (3, 0, 5)]
    batch = DraftBatch.from_trees(trees)
    assert batch.width == 5 and batch.num_nodes == [3, 0, 5]
    for b, tree in enumerate(trees):
        back = batch.tree(b)
        assert back.tokens.tolist() == tree.tokens.tolist()
        assert back.parents.tolist() == tree.parents.tolist()
        n = tree.num_nodes
        assert batch.depths[b, :n].tolist() == tree.depth_list()
        assert torch.equal(batch.ancestors[b, :n, :n], tree.ancestor_mask())
        # Padding attends only to itself and hangs off the root.
        assert torch.equal(batch.ancestors[b, n:, n:], torch.eye(5 - n, dtype=torch.bool))
        assert not batch.ancestors[b, n:, :n].any()
        assert (batch.parents[b, n:] == ROOT).all()


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


@pytest.mark.parametrize("seed", range(30))
def test_batched_greedy_verify_equals_per_tree_verify(seed) -> None:
    rng = random.Random(seed)
    vocab = rng.choice([3, 6, 10])
    trees = [random_tree(rng, rng.randint(0, 12), vocab) for _ in range(rng.randint(1, 4))]
    batch = DraftBatch.from_trees(trees)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(trees), 1 + batch.width, vocab, generator=gen)
    # Make some draft paths right so long accepts happen.
    for b, tree in enumerate(trees):
        for tok, parent in zip(tree.tokens.tolist(), tree.parents.tolist()):
            if rng.random() < 0.7:
                logits[b, parent + 1, tok] += 10.0
    got = verify_greedy_batch(batch, logits)
    for b, tree in enumerate(trees):
        want = verify(tree, logits[b, : 1 + tree.num_nodes], GREEDY)
        assert got[b].node_ids == want.node_ids
        assert got[b].token_ids == want.token_ids
        torch.testing.assert_close(torch.tensor(got[b].logprobs), torch.tensor(want.logprobs))


ROW_PARAMS = [GREEDY, SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_p=0.8),
              SamplingParams(temperature=1.3, top_k=3)]


@pytest.mark.parametrize("seed", range(40))
def test_batched_verify_equals_per_tree_verify_token_for_token(seed) -> None:
    """Any mix of greedy and sampling rows, sampled and chosen children, seeded and unseeded
    rows: the batch gives each row exactly what `verify` gives it, from the same random draws."""
    rng = random.Random(seed)
    vocab = rng.choice([3, 6, 10])
    num_rows = rng.randint(1, 5)
    gen = torch.Generator().manual_seed(seed)
    trees = []
    for _ in range(num_rows):
        shape = random_tree(rng, rng.randint(0, 10), vocab)
        n = shape.num_nodes
        q = torch.randn(n + 1, vocab, generator=gen).softmax(-1)
        q[torch.rand(n + 1, vocab, generator=gen) < 0.15] = 0.0  # some zero-probability drafts
        q = q / q.sum(-1, keepdim=True).clamp_min(1e-9)
        trees.append(DraftTree(shape.tokens, shape.parents, q,
                               torch.rand(n + 1, generator=gen) < 0.6))
    batch = DraftBatch.from_trees(trees)
    logits = torch.randn(num_rows, 1 + batch.width, vocab, generator=gen) * 2
    for b, tree in enumerate(trees):  # make some drafts likely, so long accepts happen
        for tok, parent in zip(tree.tokens.tolist(), tree.parents.tolist()):
            if rng.random() < 0.5:
                logits[b, parent + 1, tok] += 4.0
    params = [rng.choice(ROW_PARAMS) for _ in range(num_rows)]
    seeds = [rng.choice([None, rng.randrange(1000)]) for _ in range(num_rows)]

    def generators() -> list[torch.Generator | None]:
        return [None if s is None else torch.Generator().manual_seed(s) for s in seeds]

    torch.manual_seed(seed)  # the unseeded rows draw from the global RNG, in row order
    want = [verify(tree, logits[b, : 1 + tree.num_nodes], params[b], g)
            for b, (tree, g) in enumerate(zip(trees, generators()))]
    torch.manual_seed(seed)
    got = verify_batch(batch, logits, params, generators())
    for g, w in zip(got, want):
        assert g.node_ids == w.node_ids
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs))
