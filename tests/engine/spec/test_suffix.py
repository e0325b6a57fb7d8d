"""Suffix drafter: exact proposals on hand-built rollouts, and the automaton, the longest match
and the whole draft tree checked against brute-force references on seeded random sequences."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from fastdraft.engine.spec.suffix import SUFFIX_SOURCE_ID, SuffixConfig, SuffixDrafter
from fastdraft.engine.spec.suffix_index import GEN_START, ROOT_STATE, SuffixAutomaton
from fastdraft.engine.spec.tree import ROOT, DraftTree

A, B, C, D, X = 0, 1, 2, 3, 9


def tree_lists(tree: DraftTree) -> tuple[list[int], list[int]]:
    return tree.tokens.tolist(), tree.parents.tolist()


def paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Token path from the root to each node, in node order."""
    out: list[tuple[int, ...]] = []
    for tok, parent in zip(*tree_lists(tree)):
        out.append((*(out[parent] if parent != ROOT else ()), tok))
    return out


def drafter_with(rollouts: list[list[int]], generated: list[int], prompt: list[int] | None = None,
                 **cfg: object) -> SuffixDrafter:
    drafter = SuffixDrafter(SuffixConfig(**cfg))
    for rollout in rollouts:
        drafter.add_rollout("p", rollout, step=0)
    drafter.start("r", "p", prompt if prompt is not None else [X, X])
    drafter.extend("r", generated)
    return drafter


# ---- exact proposals on hand-built rollouts -----------------------------------------------------


def test_children_ordered_by_count_then_best_first():
    # "ab" occurs 3 times: followed by c twice, d once. Best-first: c (2/3), then its only
    # continuation a (2/3 * 1), b, d; then the root's d (1/3).
    drafter = drafter_with([[A, B, C, A, B, D], [A, B, C]], [X, A, B], own_text=False)
    assert drafter.longest_match("r") == 2
    assert tree_lists(drafter.propose("r")) == ([C, A, B, D, D], [ROOT, 0, 1, 2, ROOT])
    assert tree_lists(drafter.propose("r", max_depth=1)) == ([C, D], [ROOT, ROOT])
    assert tree_lists(drafter.propose("r", max_nodes=2)) == ([C, A], [ROOT, 0])


def test_equal_counts_break_ties_by_token_id():
    drafter = drafter_with([[A, B, D, A, B, C]], [X, A, B], own_text=False)
    assert tree_lists(drafter.propose("r", max_depth=1)) == ([C, D], [ROOT, ROOT])


def test_min_count_skips_rare_continuations():
    drafter = drafter_with([[A, B, C, A, B, D], [A, B, C]], [X, A, B], own_text=False, min_count=2)
    assert tree_lists(drafter.propose("r")) == ([C], [ROOT])


def test_first_draft_after_prompt_comes_from_rollout_openings():
    drafter = drafter_with([[C, A], [C, B], [D, A]], [], own_text=False)
    tokens, parents = tree_lists(drafter.propose("r", max_depth=1))
    assert (tokens, parents) == ([C, D], [ROOT, ROOT])
    # anchored at the answer start: after [C] only rollouts that opened with C count
    drafter.extend("r", [C])
    assert tree_lists(drafter.propose("r")) == ([A, B], [ROOT, ROOT])


def test_own_text_repetition_is_drafted_without_rollouts():
    drafter = drafter_with([], [5, 6, 7, 8, 5, 6])
    assert drafter.longest_match("r") == 2
    assert tree_lists(drafter.propose("r")) == ([7, 8, 5, 6], [ROOT, 0, 1, 2])
    assert tree_lists(drafter_with([], [5, 6, 7, 8, 5, 6], own_text=False).propose("r")) == ([], [])


def test_prompt_is_part_of_own_text():
    drafter = drafter_with([], [4, 5], prompt=[4, 5, 6, 7])
    assert tree_lists(drafter.propose("r")) == ([6, 7], [ROOT, 0])


def test_empty_tree_when_nothing_matches():
    drafter = drafter_with([[A, B, C]], [X, D], own_text=False)
    tree = drafter.propose("r")
    assert tree.num_nodes == 0 and tree.tokens.dtype == torch.long
    assert drafter.propose("r", max_nodes=0).num_nodes == 0
    # the match exists but is only at a rollout end: nothing follows it
    assert drafter_with([[A, B, C]], [X, C], own_text=False).propose("r").num_nodes == 0


def test_min_match_len_drops_short_matches():
    drafter = drafter_with([[A, B, C]], [X, B], own_text=False, min_match_len=2)
    assert drafter.propose("r").num_nodes == 0
    drafter.extend("r", [C, X, A, B])  # now "x a b" -> match "a b" of length 2
    assert tree_lists(drafter.propose("r")) == ([C], [ROOT])


def test_back_off_to_a_more_frequent_shorter_match():
    # "d a b" occurs once (-> c); "a b" occurs 3 times (-> c once, d twice)
    rollouts = [[D, A, B, C], [A, B, D], [A, B, D]]
    strict = drafter_with(rollouts, [X, D, A, B], own_text=False, max_depth=1)
    assert tree_lists(strict.propose("r")) == ([C], [ROOT])
    backed = drafter_with(rollouts, [X, D, A, B], own_text=False, max_depth=1, min_occurrences=2)
    assert tree_lists(backed.propose("r")) == ([D, C], [ROOT, ROOT])


def test_draft_tree_fields():
    tree = drafter_with([[A, B, C, A, B, D]], [X, A, B]).propose("r")
    assert tree.parent_probs is None and tree.is_sampled is None
    assert tree.tokens.dtype == torch.long and tree.parents.dtype == torch.long
    assert tree.sources.dtype == torch.int8
    assert tree.sources.tolist() == [SUFFIX_SOURCE_ID] * tree.num_nodes


# ---- history: window, isolation, token cap ----------------------------------------------------


def test_window_evicts_old_steps_and_ignores_stale_rollouts():
    drafter = SuffixDrafter(SuffixConfig(window_steps=1, own_text=False))
    for step, opening in enumerate([A, B, C]):
        drafter.add_rollout("p", [opening, 10 + step], step=step)
    drafter.start("r", "p", [X])

    def openings() -> list[int]:
        return drafter.propose("r", max_depth=1).tokens.tolist()

    assert openings() == [A, B, C]
    drafter.advance_step(2)  # keeps steps 1 and 2
    assert openings() == [B, C] and drafter.stored_tokens("p") == 4
    drafter.add_rollout("p", [D, 13], step=0)  # older than the window: ignored
    assert openings() == [B, C]
    drafter.advance_step(4)
    assert openings() == [] and drafter.num_prompts == 0
    drafter.add_rollout("p", [D, 14], step=4)
    assert openings() == [D]


def test_prompts_are_isolated():
    drafter = SuffixDrafter(SuffixConfig(own_text=False))
    drafter.add_rollout("p", [A, B, C], step=0)
    drafter.add_rollout("q", [A, B, D], step=0)
    drafter.start("rp", "p", [X])
    drafter.start("rq", "q", [X])
    drafter.start("rz", "z", [X])
    for rid in ("rp", "rq", "rz"):
        drafter.extend(rid, [A, B])
    assert drafter.propose("rp").tokens.tolist() == [C]
    assert drafter.propose("rq").tokens.tolist() == [D]
    assert drafter.propose("rz").num_nodes == 0


def test_token_cap_evicts_oldest_rollouts_first():
    cap = 40
    drafter = SuffixDrafter(SuffixConfig(max_tokens_per_prompt=cap, own_text=False))
    for i in range(12):  # rollout i opens with token 100 + i
        drafter.add_rollout("p", [100 + i] + [200 + i] * 9, step=0)
        assert drafter.stored_tokens("p") <= cap
    drafter.start("r", "p", [X])
    openings = sorted(drafter.propose("r", max_depth=1).tokens.tolist())
    assert openings == list(range(100 + 12 - len(openings), 100 + 12))  # the newest survive
    assert 2 <= len(openings) <= 4
    drafter.add_rollout("p", list(range(1000, 1100)), step=0)  # longer than the cap: truncated
    assert drafter.stored_tokens("p") == cap


def test_rollout_added_mid_request_is_used_at_once():
    drafter = SuffixDrafter(SuffixConfig(own_text=False))
    drafter.add_rollout("p", [A, B, C], step=0)
    drafter.start("r", "p", [X])
    drafter.extend("r", [A, B])
    assert drafter.propose("r").tokens.tolist() == [C]
    drafter.add_rollout("p", [A, B, D, D], step=0)  # grows the open segment: cursor re-matches
    assert tree_lists(drafter.propose("r")) == ([C, D, D], [ROOT, ROOT, 1])
    drafter.add_rollout("p", [A, B, D], step=1)     # a new segment: D 2/3, then D->D 2/3
    assert tree_lists(drafter.propose("r")) == ([D, D, C], [ROOT, 0, ROOT])


def test_finish_forgets_the_request_and_bad_inputs_raise():
    drafter = drafter_with([[A, B]], [A])
    drafter.finish("r")
    with pytest.raises(KeyError, match="start"):
        drafter.propose("r")
    drafter.finish("r")  # idempotent
    with pytest.raises(ValueError, match=">= 0"):
        drafter.add_rollout("p", [1, -3], step=0)
    drafter.start("r", "p", [1])
    with pytest.raises(ValueError, match=">= 0"):
        drafter.propose("r", max_nodes=-1)


def test_tensor_token_ids_are_accepted():
    drafter = SuffixDrafter(SuffixConfig(own_text=False))
    drafter.add_rollout("p", torch.tensor([A, B, C]), step=0)
    drafter.start("r", "p", torch.tensor([X]))
    drafter.extend("r", torch.tensor([A, B]))
    assert drafter.propose("r").tokens.tolist() == [C]


@pytest.mark.parametrize("kwargs, field", [
    ({"window_steps": -1}, "window_steps"),
    ({"max_match_len": 0}, "max_match_len"),
    ({"min_match_len": 0}, "min_match_len"),
    ({"min_match_len": 5, "max_match_len": 4}, "min_match_len"),
    ({"max_depth": 0}, "max_depth"),
    ({"max_nodes": 0}, "max_nodes"),
    ({"min_count": 0}, "min_count"),
    ({"min_occurrences": 0}, "min_occurrences"),
    ({"max_tokens_per_prompt": 0}, "max_tokens_per_prompt"),
    ({"max_depth": 2.5}, "max_depth"),
])
def test_bad_config_raises(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SuffixConfig(**kwargs)


# ---- brute-force references -----------------------------------------------------------------


def count_occurrences(text: list[int], pattern: list[int]) -> int:
    m = len(pattern)
    return sum(text[i:i + m] == pattern for i in range(len(text) - m + 1))


def test_automaton_counts_match_brute_force():
    rng = random.Random(0)
    for trial in range(40):
        depth = rng.randint(1, 5)
        text = [rng.randrange(1 + trial % 3) for _ in range(rng.randint(1, 120))]
        sam = SuffixAutomaton(count_depth=depth)
        sam.extend(text)
        substrings = {tuple(text[i:j]) for i in range(len(text))
                      for j in range(i + 1, min(len(text), i + depth) + 1)}
        for sub in substrings:
            state = ROOT_STATE
            for tok in sub:
                state = sam.nxt[state][tok]
            assert sam.cnt[state] == count_occurrences(text, list(sub)), (text, sub)


class BruteDrafter:
    """The drafter's rules restated over plain lists (quadratic, for tests only)."""

    def __init__(self, cfg: SuffixConfig) -> None:
        self.cfg = cfg
        self.rollouts: list[tuple[int, list[int]]] = []  # (step, framed tokens)
        self.context: list[int] = []

    def texts(self) -> list[list[int]]:
        own = [self.context] if self.cfg.own_text else []
        return [text for _, text in self.rollouts] + own

    def occurs_before_end(self, pattern: list[int]) -> bool:
        texts = [text for _, text in self.rollouts]
        if self.cfg.own_text:
            texts.append(self.context[:-1])
        return any(count_occurrences(text, pattern) for text in texts)

    def count(self, pattern: list[int]) -> int:
        return sum(count_occurrences(text, pattern) for text in self.texts())

    def longest_match(self) -> int:
        best = 0
        for m in range(1, min(self.cfg.max_match_len, len(self.context)) + 1):
            if self.occurs_before_end(self.context[-m:]):
                best = m
        return best

    def children(self, prefix: list[int]) -> dict[int, int]:
        out = {}
        for tok in {t for text in self.texts() for t in text if t >= 0}:
            c = self.count([*prefix, tok])
            if c:
                out[tok] = c
        return out

    def match(self) -> list[int] | None:
        for m in range(self.longest_match(), self.cfg.min_match_len - 1, -1):
            kids = self.children(self.context[-m:])
            if (sum(kids.values()) >= self.cfg.min_occurrences
                    and max(kids.values(), default=0) >= self.cfg.min_count):
                return self.context[-m:]
        return None

    def full_tree(self, max_depth: int) -> dict[tuple[int, ...], float]:
        """Every draftable path (no budget) -> its score."""
        match = self.match()
        out: dict[tuple[int, ...], float] = {}
        frontier: list[tuple[tuple[int, ...], float]] = [((), 1.0)] if match is not None else []
        while frontier:
            path, score = frontier.pop()
            if len(path) == max_depth:
                continue
            kids = self.children([*match, *path])
            total = sum(kids.values())
            for tok, c in kids.items():
                if c >= self.cfg.min_count:
                    out[(*path, tok)] = score * c / total
                    frontier.append(((*path, tok), score * c / total))
        return out


def add_both(drafter: SuffixDrafter, brute: BruteDrafter, rollout: list[int], step: int) -> None:
    drafter.add_rollout("p", rollout, step)
    brute.rollouts.append((step, [GEN_START, *rollout, -100 - len(brute.rollouts)]))


def check_tree(tree: DraftTree, brute: BruteDrafter, max_nodes: int, max_depth: int) -> None:
    full = brute.full_tree(max_depth)
    got = paths(tree)
    assert len(set(got)) == len(got)
    assert tree.num_nodes == min(max_nodes, len(full))
    assert set(got) <= set(full)
    if tree.num_nodes:
        assert max(tree.depth_list(), default=0) <= max_depth
        scores = [full[p] for p in got]
        assert all(a >= b - 1e-12 for a, b in itertools.pairwise(scores)), "not best-first"
        # nothing left out scores more than what was kept
        left_out = [score for path, score in full.items() if path not in set(got)]
        assert max(left_out, default=0.0) <= scores[-1] + 1e-12
    for kids in tree.children():  # siblings in descending score
        sib = [full[got[k]] for k in kids]
        assert sib == sorted(sib, reverse=True)


def test_random_histories_match_brute_force():
    rng = random.Random(1)
    for trial in range(60):
        cfg = SuffixConfig(window_steps=rng.randint(0, 2), max_match_len=rng.randint(1, 6),
                           min_match_len=1, max_depth=rng.randint(1, 4),
                           max_nodes=rng.randint(1, 12), min_count=rng.choice([1, 1, 2]),
                           min_occurrences=rng.choice([1, 1, 3]), own_text=rng.random() < 0.7)
        vocab = rng.randint(2, 4)
        drafter, brute = SuffixDrafter(cfg), BruteDrafter(cfg)
        step = 0
        for _ in range(rng.randint(0, 4)):
            add_both(drafter, brute, [rng.randrange(vocab) for _ in range(rng.randint(0, 25))], 0)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        drafter.start("r", "p", prompt)
        brute.context = [*prompt, GEN_START]
        for _ in range(12):
            event = rng.random()
            if event < 0.15:
                add_both(drafter, brute, [rng.randrange(vocab) for _ in range(rng.randint(1, 20))],
                         step)
            elif event < 0.25:
                step += 1
                drafter.advance_step(step)
                brute.rollouts = [(s, t) for s, t in brute.rollouts
                                  if s >= step - cfg.window_steps]
            new = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
            drafter.extend("r", new)
            brute.context += new
            assert drafter.longest_match("r") == brute.longest_match(), trial
            max_nodes = rng.choice([None, 1, 3, 50])
            tree = drafter.propose("r", max_nodes=max_nodes)
            check_tree(tree, brute, cfg.max_nodes if max_nodes is None else max_nodes,
                       cfg.max_depth)


def test_long_random_answers_keep_longest_match_exact():
    """Longer texts and a bigger vocabulary: cursors advance incrementally over many extends,
    and max_match_len caps the match."""
    rng = random.Random(2)
    cfg = SuffixConfig(max_match_len=8, own_text=True)
    for _ in range(5):
        drafter, brute = SuffixDrafter(cfg), BruteDrafter(cfg)
        base = [rng.randrange(6) for _ in range(80)]
        for _ in range(3):
            add_both(drafter, brute, [t if rng.random() > 0.1 else rng.randrange(6) for t in base],
                     0)
        drafter.start("r", "p", [7])
        brute.context = [7, GEN_START]
        for tok in [t if rng.random() > 0.1 else rng.randrange(6) for t in base]:
            drafter.extend("r", [tok])
            brute.context.append(tok)
            assert drafter.longest_match("r") == brute.longest_match()
        check_tree(drafter.propose("r"), brute, cfg.max_nodes, cfg.max_depth)
