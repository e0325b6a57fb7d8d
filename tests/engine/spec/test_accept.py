"""Batched verification in tensor ops (spec/accept.py) against the per-tree reference
(spec/verify.py): token for token, logprob for logprob, from the same uniforms, over random
trees and any mix of greedy, sampled and filtered rows with sampled and chosen children."""

from __future__ import annotations

import random

import pytest
import torch

from fastdraft.engine.sampler import SamplingTensors
from fastdraft.engine.sampling_params import SamplingParams
from fastdraft.engine.spec.accept import accept_greedy, accept_sampled, tree_links
from fastdraft.engine.spec.batch import DraftBatch
from fastdraft.engine.spec.tree import DraftTree, children_lists
from fastdraft.engine.spec.verify import verify
from tests.engine.spec.test_draft_batch import random_tree

GREEDY = SamplingParams(greedy=True)
ROW_PARAMS = [GREEDY, SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_p=0.8),
              SamplingParams(temperature=1.3, top_k=3)]


def _max_depth(trees: list[DraftTree]) -> int:
    return max((max(t.depth_list(), default=0) for t in trees), default=0) + 1


@pytest.mark.parametrize("seed", range(20))
def test_tree_links_follow_the_children_lists(seed) -> None:
    rng = random.Random(seed)
    trees = [random_tree(rng, rng.randint(0, 9), 6) for _ in range(3)]
    batch = DraftBatch.from_trees(trees)
    first_child, next_sibling = tree_links(batch.parents, batch.num_nodes)
    for b, tree in enumerate(trees):
        children = children_lists(tree.parents.tolist())
        for row, kids in enumerate(children):
            assert first_child[b, row] == (kids[0] if kids else -1)
            for a, nxt in zip(kids, [*kids[1:], -1]):
                assert next_sibling[b, a] == nxt


@pytest.mark.parametrize("seed", range(30))
def test_batched_greedy_accept_equals_per_tree_verify(seed) -> None:
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
    depth = _max_depth(trees) + rng.randint(0, 2)  # a deeper bound than needed changes nothing
    got = accept_greedy(batch, logits, depth)
    for b, tree in enumerate(trees):
        want = verify(tree, logits[b, : 1 + tree.num_nodes], GREEDY)
        _assert_row_equals(got, b, want)


@pytest.mark.parametrize("seed", range(40))
def test_batched_sampled_accept_equals_per_tree_verify(seed) -> None:
    """Any mix of greedy and sampling rows, sampled and chosen children: each row gets exactly
    what `verify` gives it from the same uniforms."""
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
                               torch.rand(n, generator=gen) < 0.6))  # kinds mixed
    batch = DraftBatch.from_trees(trees)
    logits = torch.randn(num_rows, 1 + batch.width, vocab, generator=gen) * 2
    for b, tree in enumerate(trees):  # make some drafts likely, so long accepts happen
        for tok, parent in zip(tree.tokens.tolist(), tree.parents.tolist()):
            if rng.random() < 0.5:
                logits[b, parent + 1, tok] += 4.0
    params = [rng.choice(ROW_PARAMS) for _ in range(num_rows)]
    node_u = torch.rand(num_rows, batch.width, generator=gen, dtype=torch.float64)
    bonus_u = torch.rand(num_rows, generator=gen, dtype=torch.float64)
    st = SamplingTensors.build(params, vocab, "cpu")
    got = accept_sampled(batch, logits, st, node_u, bonus_u, _max_depth(trees))
    early = accept_sampled(batch, logits, st, node_u, bonus_u, _max_depth(trees),
                           stop_early=True)
    for field in ("path", "num_accepted", "token_ids", "logprobs"):
        assert torch.equal(getattr(got, field), getattr(early, field))
    for b, tree in enumerate(trees):
        n = tree.num_nodes
        want = verify(tree, logits[b, : 1 + n], params[b],
                      uniforms=[*node_u[b, :n].tolist(), float(bonus_u[b])])
        _assert_row_equals(got, b, want)


def _assert_row_equals(got, b: int, want) -> None:
    n = int(got.num_accepted[b])
    assert got.path[b, :n].tolist() == want.node_ids
    assert (got.path[b, n:] == -1).all()
    assert got.token_ids[b, : n + 1].tolist() == want.token_ids
    torch.testing.assert_close(got.logprobs[b, : n + 1], torch.tensor(want.logprobs))
