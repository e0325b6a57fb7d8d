"""Unit tests of tree verification: greedy exactness, shapes of Accepted, logprobs, top-k / top-p,
edge cases (empty trees, zero-probability drafts, degenerate residuals), processed_probs and the
conditioned Gumbel keys. The distributional proof is in test_lossless_stats.py."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from fastdraft.engine.sampler import SamplingTensors, filter_top_k_top_p, sample
from fastdraft.engine.sampling_params import SamplingParams
from fastdraft.engine.spec import verify as verify_mod
from fastdraft.engine.spec.probs import (
    conditioned_gumbel_keys,
    conditioned_gumbel_topk,
    policy_logprobs,
    processed_probs,
)
from fastdraft.engine.spec.tree import ROOT, DraftTree
from fastdraft.engine.spec.verify import verify
from tests.engine.spec.stat_utils import chi_square_pvalue

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # Tiny tensors: one intra-op thread is microseconds per op, a contended pool milliseconds.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def random_tree(rng: random.Random, num_nodes: int, vocab: int, max_children: int = 3
                ) -> DraftTree:
    """Random tree shape and tokens (repeats among siblings allowed), no draft probs."""
    parents: list[int] = []
    counts = Counter()
    for i in range(num_nodes):
        options = [p for p in range(ROOT, i) if counts[p] < max_children]
        parent = rng.choice(options)
        counts[parent] += 1
        parents.append(parent)
    tokens = [rng.randrange(vocab) for _ in range(num_nodes)]
    return DraftTree(torch.tensor(tokens, dtype=torch.long),
                     torch.tensor(parents, dtype=torch.long), None, None)


def sampled_tree(tokens: list[int], parents: list[int], q: torch.Tensor) -> DraftTree:
    """Tree whose every node counts as drawn from its parent's row of q [N + 1, V]."""
    n = len(tokens)
    return DraftTree(torch.tensor(tokens, dtype=torch.long),
                     torch.tensor(parents, dtype=torch.long), q,
                     torch.ones(n, dtype=torch.bool))


def brute_force_greedy(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """Reference: among all root-to-node paths whose every token is its parent row's argmax, the
    longest (ties: smallest node ids, i.e. first matching sibling), then the argmax bonus."""
    best = logits.argmax(-1).tolist()
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    paths: list[list[int]] = [[]]
    for i in range(tree.num_nodes):
        chain, node = [], i
        while node != ROOT:
            chain.append(node)
            node = parents[node]
        chain.reverse()
        if all(tokens[c] == best[(parents[c] + 1)] for c in chain):
            paths.append(chain)
    # The first matching sibling wins, so a path through a later duplicate sibling is invalid.
    def first_match(c: int) -> bool:
        sibs = [j for j in range(tree.num_nodes) if parents[j] == parents[c]]
        return next(j for j in sibs if tokens[j] == tokens[c]) == c
    paths = [p for p in paths if all(first_match(c) for c in p)]
    path = max(paths, key=len)
    return path, best[path[-1] + 1 if path else 0]


# ---------------------------------------------------------------- greedy

def test_greedy_matches_brute_force_on_random_trees() -> None:
    rng = random.Random(0)
    for trial in range(300):
        vocab = rng.choice([2, 3, 5])
        tree = random_tree(rng, rng.randrange(0, 20), vocab)
        gen = torch.Generator().manual_seed(trial)
        logits = torch.randn(tree.num_nodes + 1, vocab, generator=gen)
        acc = verify(tree, logits, GREEDY)
        path, bonus = brute_force_greedy(tree, logits)
        assert acc.node_ids == path
        assert acc.token_ids == [*tree.tokens[path].tolist(), bonus]


def test_greedy_ties_follow_torch_argmax() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    tree = DraftTree(torch.tensor([2, 1]), torch.tensor([ROOT, ROOT]), None, None)
    acc = verify(tree, logits, GREEDY)
    assert acc.node_ids == [1] and acc.token_ids == [1, 0]


class DeterministicModel:
    """Synthetic causal LM: next-token logits are a seeded table row chosen by a context hash."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab = vocab
        self.table = torch.randn(997, vocab, generator=torch.Generator().manual_seed(seed))

    def logits(self, ctx: tuple[int, ...]) -> torch.Tensor:
        h = 11
        for t in ctx:
            h = (h * 131 + t + 1) % 997
        return self.table[h]


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.7, greedy=True)])
def test_greedy_sd_equals_plain_greedy_decoding(params: SamplingParams) -> None:
    """Token for token and logprob for logprob, with trees that are partly right."""
    model, rng, length = DeterministicModel(vocab=7, seed=3), random.Random(1), 40
    st = SamplingTensors.build([params], model.vocab, torch.device("cpu"))
    plain, plain_lp, ctx = [], [], ()
    for _ in range(length):
        tok, lp = sample(model.logits(ctx).unsqueeze(0), st, None)
        plain.append(int(tok))
        plain_lp.append(float(lp))
        ctx = (*ctx, int(tok))

    out, out_lp, steps = [], [], 0
    while len(out) < length:
        # Draft: each node's children are the true next token (with prob 0.7) plus random ones.
        tokens, parents, ctxs = [], [], [tuple(out)]
        frontier = [ROOT]
        for _ in range(3):
            nxt = []
            for node in frontier:
                truth = int(model.logits(ctxs[node + 1]).argmax())
                kids = [truth] if rng.random() < 0.7 else []
                kids += [rng.randrange(model.vocab) for _ in range(rng.randrange(3))]
                rng.shuffle(kids)
                for t in kids:
                    tokens.append(t)
                    parents.append(node)
                    ctxs.append((*ctxs[node + 1], t))
                    nxt.append(len(tokens) - 1)
            frontier = nxt
        tree = DraftTree(torch.tensor(tokens, dtype=torch.long),
                         torch.tensor(parents, dtype=torch.long), None, None)
        target = torch.stack([model.logits(c) for c in ctxs])
        acc = verify(tree, target, params)
        out += acc.token_ids
        out_lp += acc.logprobs
        steps += 1
    assert out[:length] == plain
    assert out_lp[:length] == pytest.approx(plain_lp, abs=1e-5)
    assert steps < length  # the drafts did speed it up


def test_chain_all_right_accepts_all_plus_bonus_and_first_error_stops() -> None:
    logits = torch.eye(5)[[1, 2, 3, 4]] * 5          # argmax after root 1, then 2, 3, 4
    right = DraftTree(torch.tensor([1, 2, 3]), torch.tensor([ROOT, 0, 1]), None, None)
    acc = verify(right, logits, GREEDY)
    assert acc.node_ids == [0, 1, 2] and acc.token_ids == [1, 2, 3, 4]
    wrong = DraftTree(torch.tensor([1, 0, 3]), torch.tensor([ROOT, 0, 1]), None, None)
    acc = verify(wrong, logits, GREEDY)
    assert acc.node_ids == [0] and acc.token_ids == [1, 2]


def test_no_matching_child_gives_only_the_bonus_token() -> None:
    logits = torch.tensor([[0.0, 0.0, 5.0], [5.0, 0.0, 0.0], [5.0, 0.0, 0.0]])
    tree = DraftTree(torch.tensor([0, 1]), torch.tensor([ROOT, ROOT]), None, None)
    acc = verify(tree, logits, GREEDY)
    assert acc.node_ids == [] and acc.token_ids == [2]
    assert acc.logprobs == pytest.approx([float(logits[0].log_softmax(-1)[2])])


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, top_p=0.9)])
def test_empty_tree_gives_one_token(params: SamplingParams) -> None:
    logits = torch.tensor([[0.0, 4.0, 1.0]])
    acc = verify(DraftTree.empty(), logits, params, torch.Generator().manual_seed(0))
    assert acc.node_ids == [] and len(acc.token_ids) == 1 and len(acc.logprobs) == 1
    if params.is_greedy:
        assert acc.token_ids == [1]


def test_empty_tree_bonus_is_distributed_as_processed_p() -> None:
    params = SamplingParams(temperature=0.7, top_p=0.9)
    logits = torch.tensor([[0.5, 1.0, -0.3, 0.2, 1.4]])
    gen = torch.Generator().manual_seed(5)
    counts = Counter(tuple(verify(DraftTree.empty(), logits, params, gen).token_ids)
                     for _ in range(4000))
    p = processed_probs(logits[0], params).tolist()
    assert chi_square_pvalue(counts, {(t,): pr for t, pr in enumerate(p) if pr > 0}) > 0.01


# ---------------------------------------------------------------- sampling: shapes, logprobs

def random_sampled_case(seed: int, vocab: int = 6) -> tuple[DraftTree, torch.Tensor]:
    rng = random.Random(seed)
    shape = random_tree(rng, rng.randrange(1, 15), vocab)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(shape.num_nodes + 1, vocab, generator=gen).softmax(-1)
    tree = DraftTree(shape.tokens, shape.parents, q,
                     torch.rand(shape.num_nodes, generator=gen) < 0.5)
    return tree, torch.randn(shape.num_nodes + 1, vocab, generator=gen) * 2


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.6, top_p=0.8),
                                    SamplingParams(temperature=1.3, top_k=3), GREEDY])
def test_accepted_is_a_root_path_with_matching_lengths_and_logprobs(params: SamplingParams
                                                                    ) -> None:
    for seed in range(60):
        tree, logits = random_sampled_case(seed)
        acc = verify(tree, logits, params, torch.Generator().manual_seed(seed))
        assert len(acc.token_ids) == len(acc.node_ids) + 1 == len(acc.logprobs)
        parent = ROOT
        for node in acc.node_ids:
            assert int(tree.parents[node]) == parent
            parent = node
        assert acc.token_ids[:-1] == tree.tokens[acc.node_ids].tolist()
        rows = [0] + [n + 1 for n in acc.node_ids]
        expect = policy_logprobs(logits[rows], params)[range(len(rows)), acc.token_ids]
        assert acc.logprobs == pytest.approx(expect.tolist(), abs=1e-6)
        temp = 1.0 if params.is_greedy else params.temperature
        assert acc.logprobs[0] == pytest.approx(
            float((logits[0] / temp).log_softmax(-1)[acc.token_ids[0]]), abs=1e-6)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, top_k=1),
                                    SamplingParams(temperature=1.5, top_p=1e-6)])
def test_top_k_1_or_tiny_top_p_makes_sampling_verify_equal_greedy(params: SamplingParams
                                                                  ) -> None:
    for seed in range(100):
        tree, logits = random_sampled_case(seed, vocab=3)
        acc = verify(tree, logits, params, torch.Generator().manual_seed(seed))
        assert acc.token_ids == verify(tree, logits, GREEDY).token_ids


def test_tokens_outside_the_nucleus_are_never_accepted_or_emitted() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.7, top_k=4)
    for seed in range(200):
        tree, logits = random_sampled_case(seed)
        acc = verify(tree, logits, params, torch.Generator().manual_seed(seed))
        rows = [0] + [n + 1 for n in acc.node_ids]
        allowed = processed_probs(logits[rows], params) > 0
        assert all(bool(allowed[i, t]) for i, t in enumerate(acc.token_ids))


def test_seeded_generator_reproduces_and_global_rng_is_used_without_one() -> None:
    tree, logits = random_sampled_case(3)
    params = SamplingParams(temperature=1.0)
    runs = [verify(tree, logits, params, torch.Generator().manual_seed(9)) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    torch.manual_seed(0)
    first = [verify(tree, logits, params).token_ids for _ in range(30)]
    torch.manual_seed(0)
    assert [verify(tree, logits, params).token_ids for _ in range(30)] == first
    assert len({tuple(t) for t in first}) > 1


# ---------------------------------------------------------------- edge cases and guards

def test_sampled_child_with_zero_draft_probability_is_skipped() -> None:
    # p is a point mass on token 2 (top_k=1) but q(2) = 0: the listed child 2 could not have been
    # drawn, so it is skipped, and the bonus (from the untouched p) is still token 2.
    logits = torch.tensor([[0.0, 0.0, 9.0], [0.0, 0.0, 0.0]])
    q = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    tree = sampled_tree([2], [ROOT], q)
    acc = verify(tree, logits, SamplingParams(temperature=1.0, top_k=1),
                 torch.Generator().manual_seed(0))
    assert acc.node_ids == [] and acc.token_ids == [2]


def test_repeated_sampled_sibling_is_never_accepted_after_its_rejection() -> None:
    # q puts most mass on token 0, p none: the first 0 is rejected, its repeat must be skipped.
    logits = torch.tensor([[-30.0, 0.0, 0.0], [0.0] * 3, [0.0] * 3])
    q = torch.tensor([[0.9, 0.05, 0.05], [1 / 3] * 3, [1 / 3] * 3])
    tree = sampled_tree([0, 0], [ROOT, ROOT], q)
    for seed in range(50):
        acc = verify(tree, logits, SamplingParams(), torch.Generator().manual_seed(seed))
        assert acc.node_ids == [] and acc.token_ids[0] in (1, 2)


def test_degenerate_residuals_stay_finite() -> None:
    p = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    residual, q = verify_mod._reject_sampled(p, p.clone(), 1)     # p == q: residual mass 0
    assert torch.equal(residual, p) and q.tolist() == pytest.approx([2 / 7, 0.0, 5 / 7])
    residual, q = verify_mod._reject_sampled(p, torch.tensor([0.0, 1.0, 0.0],
                                                             dtype=torch.float64), 1)
    assert residual.tolist() == pytest.approx([2 / 7, 0.0, 5 / 7])
    assert torch.equal(q, torch.zeros(3, dtype=torch.float64))  # no draft mass left
    one_hot = torch.tensor([0.0, 1.0, 0.0])
    assert torch.equal(verify_mod._reject_chosen(one_hot, 1), one_hot)
    assert verify_mod._reject_chosen(p, 2).tolist() == pytest.approx([0.4, 0.6, 0.0])


def test_residual_is_max_p_minus_q_normalised() -> None:
    p = torch.tensor([0.5, 0.1, 0.4])
    q = torch.tensor([0.2, 0.6, 0.2])
    residual, q_next = verify_mod._reject_sampled(p, q, 1)
    assert residual.tolist() == pytest.approx([0.6, 0.0, 0.4])
    assert q_next.tolist() == pytest.approx([0.5, 0.0, 0.5])


def test_bad_inputs_raise() -> None:
    tree = DraftTree(torch.tensor([1]), torch.tensor([ROOT]), None, torch.tensor([True]))
    with pytest.raises(ValueError, match="parent_probs"):
        verify(tree, torch.zeros(2, 3), SamplingParams())
    with pytest.raises(ValueError, match="num_nodes"):
        verify(tree, torch.zeros(3, 3), GREEDY)


# ---------------------------------------------------------------- processed probs and keys

def test_processed_probs_matches_the_sampler_filter_and_batch_dims() -> None:
    logits = torch.randn(2, 3, 9, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.7, top_p=0.6, top_k=5)
    probs = processed_probs(logits, params)
    assert probs.shape == (2, 3, 9)
    assert torch.allclose(probs.sum(-1), torch.ones(2, 3))
    assert bool(((probs > 0).sum(-1) <= 5).all())
    for row, pr in zip(logits.reshape(-1, 9), probs.reshape(-1, 9)):
        # top-k first, then the smallest nucleus of the top-k renormalised distribution.
        ranked = (row / 0.7).sort(descending=True).values[:5].softmax(-1)
        kept = int((pr > 0).sum())
        assert kept == 1 or float(ranked[:kept - 1].sum()) < 0.6
        assert kept == 5 or float(ranked[:kept].sum()) >= 0.6
    st = SamplingTensors.build([params] * 6, 9, torch.device("cpu"))
    expect = filter_top_k_top_p(logits.reshape(6, 9) / 0.7, st.top_k, st.top_p).softmax(-1)
    assert torch.allclose(probs.reshape(6, 9), expect)
    assert torch.equal(processed_probs(logits, SamplingParams(temperature=1.0)),
                       logits.softmax(-1))
    greedy = processed_probs(logits, GREEDY)
    assert torch.equal(greedy.argmax(-1), logits.argmax(-1)) and torch.equal(greedy.sum(-1),
                                                                             torch.ones(2, 3))


def test_policy_logprobs_ignore_filters_and_use_t1_for_greedy() -> None:
    logits = torch.randn(4, 6)
    filtered = SamplingParams(temperature=0.5, top_k=2)
    assert torch.allclose(policy_logprobs(logits, filtered), (logits / 0.5).log_softmax(-1))
    assert torch.allclose(policy_logprobs(logits, SamplingParams(temperature=0.5, greedy=True)),
                          logits.log_softmax(-1))


def test_conditioned_gumbel_keys_keep_the_draw_order_and_max_at_the_parent_key() -> None:
    log_q = torch.randn(50, 8, dtype=torch.float64).log_softmax(-1)
    log_q[:, 3] = -math.inf
    parent = torch.randn(50, dtype=torch.float64) * 3
    keys = conditioned_gumbel_keys(log_q, parent, torch.Generator().manual_seed(1))
    gumbel = -torch.empty_like(log_q).exponential_(generator=torch.Generator().manual_seed(1)).log()
    raw = parent[:, None] + log_q + gumbel
    assert torch.isneginf(keys[:, 3]).all()
    assert torch.allclose(keys.amax(-1), parent)
    assert torch.equal(keys.argsort(-1, descending=True), raw.argsort(-1, descending=True))
    finite = torch.isfinite(raw)
    z = raw.amax(-1, keepdim=True)
    direct = -torch.log(torch.exp(-parent[:, None]) - torch.exp(-z) + torch.exp(-raw))
    assert torch.allclose(keys[finite], direct[finite], atol=1e-9)


def test_conditioned_gumbel_topk_is_the_topk_of_the_conditioned_keys() -> None:
    log_q = torch.randn(40, 3, 8, dtype=torch.float64).log_softmax(-1)
    log_q[:, :, 5] = -math.inf
    parent = torch.randn(40, 3, dtype=torch.float64)
    noise = torch.empty_like(log_q).exponential_(generator=torch.Generator().manual_seed(3))
    want = conditioned_gumbel_keys(log_q, parent, noise=noise).topk(8, dim=-1)
    idx, keys = conditioned_gumbel_topk(log_q, parent, 8, noise)
    assert torch.equal(idx, want.indices)
    torch.testing.assert_close(keys, want.values, atol=1e-12, rtol=0)
    assert torch.isneginf(keys[..., -1]).all()  # the excluded token comes last, still -inf


def test_conditioned_gumbel_first_child_is_distributed_as_q() -> None:
    log_q = torch.tensor([0.5, 0.2, 0.2, 0.1], dtype=torch.float64).log().expand(20000, 4)
    keys = conditioned_gumbel_keys(log_q, torch.full((20000,), -1.0, dtype=torch.float64),
                                   torch.Generator().manual_seed(2))
    counts = Counter((int(t),) for t in keys.argmax(-1))
    assert chi_square_pvalue(counts, {(0,): 0.5, (1,): 0.2, (2,): 0.2, (3,): 0.1}) > 0.01


@pytest.mark.parametrize("parents", [[0], [ROOT, 1], [ROOT, -2], [ROOT, 0, 3]])
def test_a_tree_whose_parent_is_not_an_earlier_node_is_refused(parents):
    with pytest.raises(AssertionError, match="earlier node"):
        DraftTree(torch.zeros(len(parents), dtype=torch.long), torch.tensor(parents), None, None)


def test_a_tree_with_valid_parents_is_accepted():
    tree = DraftTree(torch.zeros(4, dtype=torch.long), torch.tensor([ROOT, 0, ROOT, 1]), None, None)
    assert tree.depth_list() == [1, 2, 1, 3]
