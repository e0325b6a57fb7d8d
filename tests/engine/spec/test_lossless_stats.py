"""The proof that sampling verification is lossless: speculative continuations of a toy policy
follow the policy's exact distribution (chi-square over all V^L continuations).

A toy policy p(.|context) and a correlated but different drafter q(.|context) over a vocabulary
of V tokens are tables indexed by a hash of the context. A continuation of L tokens is built by
repeatedly drafting a tree from q, verifying it with the real `verify`, and appending the result.
Each tree shape a proposer may produce is checked at several temperature / top-p / top-k settings,
and deliberately broken acceptance rules (and the naive perturbed-key pruned tree) must be
detected with the same sample size, which shows the test has the power to see a real error.
"""

from __future__ import annotations

import functools
import math
import random
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from fastdraft.engine.sampling_params import SamplingParams
from fastdraft.engine.spec import verify as verify_mod
from fastdraft.engine.spec.graft import graft
from fastdraft.engine.spec.probs import processed_probs
from fastdraft.engine.spec.tree import ROOT, DraftTree
from fastdraft.engine.spec.verify import verify
from tests.engine.spec.stat_utils import chi_square_test, exact_sequence_probs

V = 6                 # vocabulary
L = 3                 # continuation length compared
NUM_ROWS = 1021       # distinct contexts of the toy models (contexts are hashed onto rows)
NUM_SAMPLES = 10_000
PRUNED_SAMPLES = 20_000   # the pruned trees: the naive keys' bias gives p=0.008 at 10k, so they
                          # and the trees that must pass beside them draw 20k
PASS_P = 0.01         # a lossless scheme must give p-value above this...
DETECT_P = 1e-4       # ...and a broken one below this, with the same sample size


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # Ops on [N, 6] tensors are microseconds on one thread but can take milliseconds when the
    # intra-op pool of 2 threads is contended by other processes; these tests are all tiny ops.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------- toy policy and drafter

def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    """-> (policy logits [NUM_ROWS, V], drafter logits [NUM_ROWS, V]), fp64, fixed seed."""
    gen = torch.Generator().manual_seed(1234)
    p_logits = 1.0 * torch.randn(NUM_ROWS, V, generator=gen, dtype=torch.float64)
    # Correlated with p, but different enough that rejections are frequent (accept ~60-75%).
    q_logits = 0.7 * p_logits + 1.0 * torch.randn(NUM_ROWS, V, generator=gen, dtype=torch.float64)
    return p_logits, q_logits


P_LOGITS, Q_LOGITS = _tables()


def ctx_row(ctx: tuple[int, ...]) -> int:
    """Row of the model tables for a context (the tokens generated so far)."""
    h = 7
    for t in ctx:
        h = (h * 131 + t + 1) % NUM_ROWS
    return h


@dataclass(frozen=True)
class Setting:
    """The toy models processed for one SamplingParams (target and draft processed alike)."""

    params: SamplingParams
    p_probs: list[list[float]]      # [NUM_ROWS][V] exact policy next-token probabilities
    q_probs: torch.Tensor           # [NUM_ROWS, V] drafter probabilities (parent_probs rows)
    q_list: list[list[float]]
    log_q: list[list[float]]        # -inf where q = 0 (filtered out)


@functools.cache
def setting(params: SamplingParams) -> Setting:
    q = processed_probs(Q_LOGITS, params)
    q_list = q.tolist()
    return Setting(params=params, p_probs=processed_probs(P_LOGITS, params).tolist(), q_probs=q,
                   q_list=q_list,
                   log_q=[[math.log(v) if v > 0 else -math.inf for v in r] for r in q_list])


# ---------------------------------------------------------------- draft trees

@dataclass
class Draft:
    """A tree under construction: nodes in creation order (parents before children)."""

    tokens: list[int]
    parents: list[int]
    rows: list[int]          # [N + 1] model row of the root's context, then of each node's
    ctxs: list[tuple[int, ...]]
    sampled: list[bool]      # [N] per node: drawn from its parent's q (else chosen)

    @classmethod
    def start(cls, ctx: tuple[int, ...]) -> Draft:
        return cls([], [], [ctx_row(ctx)], [ctx], [])

    def add(self, parent: int, token: int, sampled: bool = False) -> int:
        ctx = (*self.ctxs[parent + 1], token)
        self.tokens.append(token)
        self.parents.append(parent)
        self.rows.append(ctx_row(ctx))
        self.ctxs.append(ctx)
        self.sampled.append(sampled)
        return len(self.tokens) - 1

    def row(self, node: int) -> int:
        return self.rows[node + 1]

    def to_tree(self, s: Setting) -> DraftTree:
        return DraftTree(torch.tensor(self.tokens, dtype=torch.long),
                         torch.tensor(self.parents, dtype=torch.long),
                         s.q_probs[self.rows], torch.tensor(self.sampled))


Builder = Callable[[Setting, tuple[int, ...], random.Random, torch.Generator], Draft]


def _gumbel(rng: random.Random) -> float:
    return -math.log(rng.expovariate(1.0))


def gumbel_top_k(s: Setting, row: int, k: int, rng: random.Random) -> list[tuple[int, float]]:
    """k tokens sampled without replacement from q[row] (in draw order) with their perturbed
    keys log q + Gumbel (Gumbel-top-k trick)."""
    keys = [(lq + _gumbel(rng), t) for t, lq in enumerate(s.log_q[row]) if lq > -math.inf]
    keys.sort(reverse=True)
    return [(t, key) for key, t in keys[:k]]


def chain(depth: int) -> Builder:
    def build(s: Setting, ctx, rng, gen) -> Draft:
        d, node = Draft.start(ctx), ROOT
        for _ in range(depth):
            tok = rng.choices(range(V), weights=s.q_list[d.row(node)])[0]
            node = d.add(node, tok, sampled=True)
        return d
    return build


def gumbel_tree(k: int, depth: int) -> Builder:
    """Every node up to `depth` gets k children drawn without replacement from q."""
    def build(s: Setting, ctx, rng, gen) -> Draft:
        d = Draft.start(ctx)
        level = [ROOT]
        for _ in range(depth):
            nxt = []
            for node in level:
                nxt += [d.add(node, t, sampled=True)
                        for t, _ in gumbel_top_k(s, d.row(node), k, rng)]
            level = nxt
        return d
    return build


def pruned_tree(k: int, depth: int, beam: int, keep: int, keys: str,
                as_point_masses: bool = False) -> Builder:
    """EAGLE-2-style tree: per depth expand the `beam` best nodes with k children each (drawn
    without replacement from q), then keep the global top-`keep` nodes by key (plus ancestors).

    keys="naive": key = parent key + log q + Gumbel (the scheme under test; found lossy).
    keys="conditioned": Stochastic-Beam-Search keys as `probs.conditioned_gumbel_keys` (lossless).
    as_point_masses: verify the kept children as chosen point masses instead of as q-samples.
    """
    def build(s: Setting, ctx, rng, gen) -> Draft:
        d = Draft.start(ctx)
        key = {ROOT: 0.0}
        level = [ROOT]
        for _ in range(depth):
            level = sorted(level, key=lambda n: -key[n])[:beam]
            nxt = []
            for node in level:
                kids = gumbel_top_k(s, d.row(node), k, rng)
                if keys == "conditioned":
                    kids = conditioned(kids, key[node])
                else:
                    kids = [(t, key[node] + kv) for t, kv in kids]
                for t, kv in kids:
                    child = d.add(node, t)
                    key[child] = kv
                    nxt.append(child)
            level = nxt
        return _keep_top(d, key, keep, sampled=not as_point_masses)
    return build


def conditioned(kids: list[tuple[int, float]], parent_key: float) -> list[tuple[int, float]]:
    """Top-down Gumbel keys (the formula of probs.conditioned_gumbel_keys, in scalar Python for
    speed; test_verify checks the library against the same formula): keys of the drawn children
    shifted by the parent key and conditioned on max = parent key. Order is unchanged."""
    shifted = [(t, parent_key + kv) for t, kv in kids]
    top = shifted[0][1]
    # -log(exp(-T) - exp(-Z) + exp(-g)), T = parent key, Z = max of all V keys = top; the first
    # child gets exactly T so that rounding never ranks it above its parent.
    return [(t, parent_key if g == top else
             -math.log(math.exp(-parent_key) - math.exp(-top) + math.exp(-g)))
            for t, g in shifted]


def _keep_top(d: Draft, key: dict[int, float], keep: int, sampled: bool) -> Draft:
    """Top-`keep` nodes by key (ties: earlier node first), closed under ancestors."""
    nodes = range(len(d.tokens))
    chosen = set(sorted(nodes, key=lambda n: (-key[n], n))[:keep])
    for n in list(chosen):
        while d.parents[n] != ROOT and d.parents[n] not in chosen:
            n = d.parents[n]
            chosen.add(n)
    out = Draft.start(d.ctxs[0])
    new_id = {ROOT: ROOT}
    for n in sorted(chosen):          # creation order: parents first, siblings in draw order
        new_id[n] = out.add(new_id[d.parents[n]], d.tokens[n], sampled)
    return out


def top_k_tree(k: int, depth: int) -> Builder:
    """Deterministic: every node's children are q's k most likely tokens (point masses)."""
    def build(s: Setting, ctx, rng, gen) -> Draft:
        d = Draft.start(ctx)
        level = [ROOT]
        for _ in range(depth):
            nxt = []
            for node in level:
                q = s.q_list[d.row(node)]
                best = sorted(range(V), key=lambda t: -q[t])[:k]
                nxt += [d.add(node, t) for t in best]
            level = nxt
        return d
    return build


def mixed_tree() -> Builder:
    """Root: 2 children sampled from q; under each, two point masses: q's top token and a
    uniformly random token (possibly the same one: a repeated point mass); then one sampled
    chain step under each of those."""
    def build(s: Setting, ctx, rng, gen) -> Draft:
        d = Draft.start(ctx)
        for a, _ in gumbel_top_k(s, d.row(ROOT), 2, rng):
            na = d.add(ROOT, a, sampled=True)
            q = s.q_list[d.row(na)]
            for b in (max(range(V), key=q.__getitem__), rng.randrange(V)):
                nb = d.add(na, b)
                tok = rng.choices(range(V), weights=s.q_list[d.row(nb)])[0]
                d.add(nb, tok, sampled=True)
        return d
    return build


def suffix_like(ctx: tuple[int, ...], depth: int = 3) -> tuple[list[int], list[int]]:
    """A model-free drafter's candidates: a chain whose every token is a fixed function of the
    context so far, then a second root candidate (tokens, parents; parents before children)."""
    tokens: list[int] = []
    parents: list[int] = []
    for _ in range(depth):
        tokens.append((ctx_row((*ctx, *tokens)) * 7 + 3) % V)
        parents.append(len(tokens) - 2 if len(tokens) > 1 else ROOT)
    return [*tokens, (tokens[0] + 1) % V], [*parents, ROOT]


def merged_tree(chosen_as_sampled: bool = False) -> Builder:
    """The multi-source tree: an EAGLE-style pruned tree of sampled children (conditioned keys)
    with suffix-like chosen candidates grafted in by the engine's own `graft` (identified with
    a sampled child where the token matches, else appended after the sampled siblings, so one
    parent has both kinds). chosen_as_sampled: flag the grafted nodes as drawn from q (what a
    per-parent flag would do) - lossy."""
    eagle = pruned_tree(3, 2, 2, 4, "conditioned")

    def build(s: Setting, ctx, rng, gen) -> Draft:
        d = eagle(s, ctx, rng, gen)
        tokens, parents = suffix_like(ctx)
        for parent, tok in graft(d.tokens, d.parents, tokens, parents, max_new=3):
            d.add(parent, tok, sampled=chosen_as_sampled)
        return d
    return build


# ---------------------------------------------------------------- sampling and the test

def continuations(builder: Builder, params: SamplingParams, length: int, num: int, seed: int
                  ) -> Counter[tuple[int, ...]]:
    """Counts of (prompt, continuation) for `num` samples: a one-token prompt drawn uniformly
    (so several root distributions are covered), then `length` tokens made by
    draft -> verify -> append."""
    s = setting(params)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    counts: Counter[tuple[int, ...]] = Counter()
    for _ in range(num):
        seq: tuple[int, ...] = (rng.randrange(V),)
        while len(seq) <= length:
            d = builder(s, seq, rng, gen)
            acc = verify(d.to_tree(s), P_LOGITS[d.rows], params, gen)
            seq = (*seq, *acc.token_ids)[:length + 1]
        counts[seq] += 1
    return counts


def exact_probs(params: SamplingParams, length: int) -> dict[tuple[int, ...], float]:
    """Exact law of (prompt, continuation): uniform prompt, then plain sampling from the policy."""
    s = setting(params)
    uniform = [1.0 / V] * V
    return exact_sequence_probs(lambda ctx: s.p_probs[ctx_row(ctx)] if ctx else uniform,
                                length + 1, V)


def fit_pvalue(case: Case) -> float:
    seed = zlib.crc32(case.name.encode())
    counts = continuations(case.builder, case.params, case.length, case.samples, seed)
    result = chi_square_test(counts, exact_probs(case.params, case.length))
    print(f"{case.name}: {result.describe()}")
    return result.pvalue


T1 = SamplingParams(temperature=1.0)
T06 = SamplingParams(temperature=0.6)
T1_P08 = SamplingParams(temperature=1.0, top_p=0.8)
T06_P08 = SamplingParams(temperature=0.6, top_p=0.8)
T08_K3 = SamplingParams(temperature=0.8, top_k=3)


@dataclass(frozen=True)
class Case:
    name: str
    builder: Builder
    params: SamplingParams
    length: int
    samples: int = NUM_SAMPLES


# Every tree shape a proposer may return, across temperature / top-p / top-k. L = 3 where the
# tree is deep enough to make the third token depend on deep acceptance decisions.
LOSSLESS = [
    Case("chain3-T1", chain(3), T1, 3),
    Case("chain3-T0.6-p0.8", chain(3), T06_P08, 2),
    Case("gumbel-k2d3-T0.6", gumbel_tree(2, 3), T06, 3),
    Case("gumbel-k3d2-T1-p0.8", gumbel_tree(3, 2), T1_P08, 2),
    Case("pruned-conditioned-keys-T1", pruned_tree(3, 3, 3, 4, "conditioned"), T1, 2,
         PRUNED_SAMPLES),
    Case("pruned-naive-keys-as-point-masses-T0.8-k3",
         pruned_tree(3, 2, 2, 4, "naive", as_point_masses=True), T08_K3, 2, PRUNED_SAMPLES),
    Case("mixed-T1", mixed_tree(), T1, 3),
    Case("merged-eagle-suffix-T1", merged_tree(), T1, 3),
    Case("merged-eagle-suffix-T0.6-p0.8", merged_tree(), T06_P08, 2),
]


@pytest.mark.parametrize("case", LOSSLESS, ids=lambda c: c.name)
def test_speculative_continuations_follow_the_policy(case: Case) -> None:
    assert fit_pvalue(case) > PASS_P


# ---------------------------------------------------------------- the test has power

_reject_sampled = verify_mod._reject_sampled


def _residual_is_p(p: torch.Tensor, q: torch.Tensor, x: int) -> tuple[torch.Tensor, torch.Tensor]:
    return p, _reject_sampled(p, q, x)[1]


def _q_not_renormalised(p: torch.Tensor, q: torch.Tensor, x: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    q_zeroed = q.clone()
    q_zeroed[x] = 0.0
    return _reject_sampled(p, q, x)[0], q_zeroed


BROKEN = {  # name -> (attribute of verify.py replaced, broken version)
    "residual-is-p": ("_reject_sampled", _residual_is_p),
    "q-not-renormalised": ("_reject_sampled", _q_not_renormalised),
    "accept-q-over-p": ("_accepts_sampled", lambda u, px, qx: u * px < qx),
    "point-mass-not-removed": ("_reject_chosen", lambda p, x: p),
}
# One token after the prompt suffices to expose these (each breaks the first level already) and
# makes every sample a single verify call.
BRANCHING = Case("gumbel-k3d2-T1", gumbel_tree(3, 2), T1, 1)
BROKEN_CASES = {name: BRANCHING for name in BROKEN}
BROKEN_CASES["point-mass-not-removed"] = Case("topk-k3d2-T1", top_k_tree(3, 2), T1, 1)


@pytest.mark.parametrize("broken", list(BROKEN))
def test_broken_acceptance_rules_are_detected(broken: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    attr, replacement = BROKEN[broken]
    monkeypatch.setattr(verify_mod, attr, replacement)
    assert fit_pvalue(BROKEN_CASES[broken]) < DETECT_P


def test_naive_perturbed_key_pruning_is_not_lossless() -> None:
    """EAGLE-2-style global top-M by cumulative key parent + log q + fresh Gumbel, children
    verified as samples from q: kept siblings need not be a prefix of the draw order and a node's
    survival depends on its later siblings' keys, whose law depends on the node's own token.
    The same tree verified as point masses, or built with conditioned keys, passes above."""
    case = Case("pruned-naive-keys-T1", pruned_tree(3, 3, 3, 2, "naive"), T1, 1, PRUNED_SAMPLES)
    assert fit_pvalue(case) < DETECT_P


def test_merged_tree_with_grafted_nodes_verified_as_samples_is_detected() -> None:
    """Grafted suffix candidates sit under parents whose other children were sampled: verifying
    them by their parent's kind (as samples from q) instead of their own (point masses) is
    lossy, and the test sees it."""
    case = Case("merged-chosen-as-sampled-T1", merged_tree(chosen_as_sampled=True), T1, 1)
    assert fit_pvalue(case) < DETECT_P
