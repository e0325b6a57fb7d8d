"""Model-free suffix drafter over recent rollouts of the same prompt (DAS-style).

In GRPO a prompt is rolled out many times per step and again every step, so earlier rollouts of
the same prompt (and repetition inside the answer itself) predict the current answer well. This
drafter needs no training: it is the fallback before the EAGLE drafter is trained and a second
draft source for long-tail requests.

Sources searched for a request: the rollouts of its prompt within the window (per-prompt index,
suffix_index.PromptIndex) and the request's own context (prompt + GEN_START + generated so far).

Match rule: the longest suffix of the context, at most max_match_len tokens, that occurs in any
source (GEN_START counts as one token, so right after the prompt the match is [GEN_START] and the
draft is the common openings of earlier answers). Back-off: if fewer than `min_occurrences` of
the match are followed by a token, or no next token occurs `min_count` times, the next shorter
suffix whose occurrence set differs is tried, down to min_match_len; below that, no draft.

Proposal: over all occurrences of the match in all sources, children of a node are its distinct
next tokens with count = occurrences of match + path; score(child) = score(parent) * count / total
count of the parent's children (the root's score is 1). Nodes are taken best-first by score up to
max_nodes and max_depth, skipping counts < min_count. Scores never grow along a path, so the nodes
come out in non-increasing score order: parents before children, siblings in descending count
(ties: smaller token id first). Drafts are CHOSEN, not sampled (parent_probs=None,
is_sampled=None): verification treats them as point masses, which keeps decoding lossless.

Costs (n = tokens in the window, S = segments of the prompt, usually one per step): add_rollout
O(len) amortised (plus <= max_match_len + max_depth count updates per token); extend O(new
tokens); propose O(S * new tokens since the last call) to advance the match cursors, plus the
tree: O(max_nodes * (sources * branching + log heap)). Eviction drops whole segments (no rebuild).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fastdraft.engine.spec.suffix_index import (
    GEN_START,
    ROOT_STATE,
    PromptIndex,
    Segment,
    SuffixAutomaton,
)
from fastdraft.engine.spec.tree import ROOT, DraftTree
from fastdraft.errors import FastdraftError

SUFFIX_SOURCE_ID = 1  # DraftTree.sources value of every suffix-drafted node

# (automaton, state): one source's view of a draft node (the state holding match + path).
_Pair = tuple[SuffixAutomaton, int]
# (count, token, pairs) of one child, as returned by _children.
_Child = tuple[int, int, list[_Pair]]


@dataclass(frozen=True, kw_only=True, slots=True)
class SuffixConfig:
    """window_steps: RL steps of history kept per prompt besides the current one (at step t,
    rollouts of steps t - window_steps .. t are searched).
    max_match_len / min_match_len: longest context suffix matched / shorter matches draft nothing.
    max_depth / max_nodes: deepest continuation / default tree budget (propose may ask for less).
    min_count: a continuation must occur at least this often to be drafted.
    min_occurrences: back off to a shorter match while fewer occurrences of the match continue.
    max_tokens_per_prompt: cap on rollout tokens kept per prompt (oldest evicted first, a
    segment of at most max_tokens_per_prompt // 4 tokens at a time); bounds memory over days.
    own_text: also search the request's own prompt + generated tokens (repetition in answers).
    """

    window_steps: int = 4
    max_match_len: int = 32
    min_match_len: int = 1
    max_depth: int = 8
    max_nodes: int = 16
    min_count: int = 1
    min_occurrences: int = 1
    max_tokens_per_prompt: int = 65536
    own_text: bool = True

    def __post_init__(self) -> None:
        minimums = {"window_steps": 0, "max_match_len": 1, "min_match_len": 1, "max_depth": 1,
                    "max_nodes": 1, "min_count": 1, "min_occurrences": 1,
                    "max_tokens_per_prompt": 1}
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise FastdraftError(f"SuffixConfig.{name} must be an int >= {minimum}, got "
                                     f"{value!r}")
        if self.min_match_len > self.max_match_len:
            raise FastdraftError(f"SuffixConfig.min_match_len ({self.min_match_len}) must be <= "
                                 f"max_match_len ({self.max_match_len}); lower it or raise the max")

    @property
    def count_depth(self) -> int:
        """Longest string whose occurrence count the indexes keep exact."""
        return self.max_match_len + self.max_depth

    @property
    def segment_tokens(self) -> int:
        return max(1, self.max_tokens_per_prompt // 4)


@dataclass(slots=True, eq=False)
class _Cursor:
    """A request's matching state in one segment, valid for `version` of it after `consumed`
    context tokens."""

    version: int = -1
    consumed: int = 0
    state: int = ROOT_STATE
    match_len: int = 0


@dataclass(slots=True, eq=False)
class _RequestState:
    prompt_key: Hashable
    own: SuffixAutomaton | None
    tail: list[int]                  # the last >= max_match_len context tokens (all if fewer)
    num_tokens: int                  # context tokens so far (prompt + GEN_START + generated)
    cursors: dict[int, _Cursor] = field(default_factory=dict)  # segment serial -> cursor


class SuffixDrafter:
    """Drafts continuation trees from earlier rollouts of a request's prompt and from its own
    text. Not thread-safe; one instance per engine. See the module doc for the rules."""

    def __init__(self, cfg: SuffixConfig = SuffixConfig()) -> None:
        self.cfg = cfg
        self._indexes: dict[Hashable, PromptIndex] = {}
        self._requests: dict[Hashable, _RequestState] = {}
        self._step: int | None = None
        self._next_serial = 0

    # ---- history --------------------------------------------------------------------------

    def add_rollout(self, prompt_key: Hashable, token_ids: Sequence[int], step: int) -> None:
        """Index a finished rollout's generated tokens for this prompt, made at RL step `step`.
        Rollouts of steps already outside the window are ignored."""
        token_ids = _as_ids(token_ids)
        if self._step is not None and step < self._step - self.cfg.window_steps:
            return
        index = self._indexes.get(prompt_key)
        if index is None:
            index = PromptIndex(count_depth=self.cfg.count_depth,
                                max_tokens=self.cfg.max_tokens_per_prompt,
                                segment_tokens=self.cfg.segment_tokens)
            self._indexes[prompt_key] = index
        index.add(list(token_ids), step, serial=self._next_serial)
        self._next_serial += 1

    def advance_step(self, step: int) -> None:
        """Step `step` begins: drop rollouts of steps < step - window_steps, and prompts left
        with none. O(prompts)."""
        self._step = step
        min_step = step - self.cfg.window_steps
        for key in list(self._indexes):
            index = self._indexes[key]
            index.evict_steps_before(min_step)
            if not index.segments:
                del self._indexes[key]

    def state_dict(self) -> dict[str, Any]:
        """The window's rollouts, oldest first per prompt (JSON; prompt keys are token-id
        tuples, as the engine's proposer uses): re-adding them in order
        rebuilds the same segments, so a resumed run drafts what an unbroken one would."""
        return {"step": self._step, "rollouts": [
            [list(key), seg.step, list(tokens)] for key, index in self._indexes.items()
            for seg in index.segments for tokens in seg.rollouts]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._indexes.clear()
        self._step = None
        for key, step, tokens in state["rollouts"]:
            self.add_rollout(tuple(key), tokens, step)
        self._step = state["step"]

    def stored_tokens(self, prompt_key: Hashable) -> int:
        """Rollout tokens currently indexed for this prompt (0 if none)."""
        index = self._indexes.get(prompt_key)
        return index.num_tokens if index is not None else 0

    @property
    def num_prompts(self) -> int:
        return len(self._indexes)

    # ---- requests -------------------------------------------------------------------------

    def start(self, request_id: Hashable, prompt_key: Hashable, prompt_ids: Sequence[int]) -> None:
        """Begin drafting for a request (replaces any state under the same id). O(prompt)."""
        prompt_ids = _as_ids(prompt_ids)
        context = [*prompt_ids, GEN_START]
        own = None
        if self.cfg.own_text:
            own = SuffixAutomaton(self.cfg.count_depth)
            own.extend(context)
        self._requests[request_id] = _RequestState(
            prompt_key=prompt_key, own=own, tail=context[-self.cfg.max_match_len:],
            num_tokens=len(context))

    def extend(self, request_id: Hashable, token_ids: Sequence[int]) -> None:
        """Append the request's newly generated tokens. O(len(token_ids)) amortised; the match
        cursors catch up lazily in propose()."""
        token_ids = _as_ids(token_ids)
        req = self._request(request_id)
        tail = req.tail
        tail.extend(token_ids)
        if len(tail) > 2 * self.cfg.max_match_len:
            del tail[: -self.cfg.max_match_len]
        req.num_tokens += len(token_ids)
        if req.own is not None:
            req.own.extend(token_ids)

    def finish(self, request_id: Hashable) -> None:
        """Forget the request (its text is NOT added as a rollout; call add_rollout for that)."""
        self._requests.pop(request_id, None)

    def longest_match(self, request_id: Hashable) -> int:
        """Length of the longest context suffix (<= max_match_len) found in any source."""
        return max((length for _, _, length in self._sources(self._request(request_id))),
                   default=0)

    def propose(self, request_id: Hashable, max_nodes: int | None = None,
                max_depth: int | None = None) -> DraftTree:
        """The draft tree for the request's next tokens; empty when nothing matches. max_nodes /
        max_depth default to the config's; max_depth is capped at cfg.max_depth (the indexes
        count continuations only that deep)."""
        num_nodes = self.cfg.max_nodes if max_nodes is None else max_nodes
        depth = self.cfg.max_depth if max_depth is None else min(max_depth, self.cfg.max_depth)
        if num_nodes < 0 or depth < 0:
            raise FastdraftError(f"max_nodes and max_depth must be >= 0, got {num_nodes}, {depth}")
        req = self._request(request_id)
        if num_nodes == 0 or depth == 0:
            return DraftTree.empty()
        match = self._select_match(self._sources(req))
        if match is None:
            return DraftTree.empty()
        tokens, parents = _best_first(*match, num_nodes=num_nodes, max_depth=depth,
                                      min_count=self.cfg.min_count)
        return _draft_tree(tokens, parents)

    # ---- internals ------------------------------------------------------------------------

    def _request(self, request_id: Hashable) -> _RequestState:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}: call start() first") from None

    def _sources(self, req: _RequestState) -> list[tuple[SuffixAutomaton, int, int]]:
        """(automaton, state, match_len) of the longest context suffix in each source that has
        one, after bringing the request's cursors up to date."""
        out: list[tuple[SuffixAutomaton, int, int]] = []
        index = self._indexes.get(req.prompt_key)
        segments = index.segments if index is not None else []
        if len(req.cursors) > len(segments):  # segments were evicted: forget their cursors
            live = {seg.serial for seg in segments}
            req.cursors = {k: c for k, c in req.cursors.items() if k in live}
        for seg in segments:
            cursor = req.cursors.get(seg.serial)
            if cursor is None:
                cursor = req.cursors[seg.serial] = _Cursor()
            self._sync(cursor, seg, req)
            if cursor.match_len:
                out.append((seg.sam, cursor.state, cursor.match_len))
        if req.own is not None:
            state, match_len = req.own.repeated_suffix(self.cfg.max_match_len)
            if match_len:
                out.append((req.own, state, match_len))
        return out

    def _sync(self, cursor: _Cursor, seg: Segment, req: _RequestState) -> None:
        """Advance the cursor over the context tokens it has not seen, or re-match the last
        max_match_len tokens (O(max_match_len)) when the segment grew since."""
        max_len = self.cfg.max_match_len
        pending = req.num_tokens - cursor.consumed
        if cursor.version != seg.version or pending > max_len:
            cursor.state, cursor.match_len = seg.sam.match(req.tail, max_len)
        elif pending:
            sam, state, match_len = seg.sam, cursor.state, cursor.match_len
            for tok in req.tail[-pending:]:
                state, match_len = sam.step(state, match_len, tok, max_len)
            cursor.state, cursor.match_len = state, match_len
        cursor.version, cursor.consumed = seg.version, req.num_tokens

    def _select_match(self, sources: list[tuple[SuffixAutomaton, int, int]]
                      ) -> tuple[list[_Child], int] | None:
        """Root children (and their total count) of the match chosen by the back-off rule."""
        cfg = self.cfg
        match_len = max((length for _, _, length in sources), default=0)
        while match_len >= cfg.min_match_len:
            pairs: list[_Pair] = []
            shorter = 0  # next length at which some source's occurrence set changes
            for sam, state, length in sources:
                if length >= match_len:
                    state = sam.shorten(state, match_len)
                    pairs.append((sam, state))
                    shorter = max(shorter, sam.length[sam.link[state]])
                else:
                    shorter = max(shorter, length)
            children, total = _children(pairs)
            if total >= cfg.min_occurrences and children and children[0][0] >= cfg.min_count:
                return children, total
            match_len = shorter
        return None


def _children(pairs: list[_Pair]) -> tuple[list[_Child], int]:
    """Distinct next tokens after a node over all its sources, by descending count then token,
    and their total count. Separators (negative tokens: rollout ends) are never drafted."""
    merged: dict[int, list] = {}
    for sam, state in pairs:
        cnt = sam.cnt
        for tok, target in sam.nxt[state].items():
            if tok < 0:
                continue
            entry = merged.get(tok)
            if entry is None:
                merged[tok] = [cnt[target], [(sam, target)]]
            else:
                entry[0] += cnt[target]
                entry[1].append((sam, target))
    children = [(count, tok, targets) for tok, (count, targets) in merged.items()]
    children.sort(key=lambda child: (-child[0], child[1]))
    return children, sum(child[0] for child in children)


def _best_first(root_children: list[_Child], root_total: int, *, num_nodes: int, max_depth: int,
                min_count: int) -> tuple[list[int], list[int]]:
    """Tokens and parent indexes of the best-first tree (see the module doc)."""
    heap: list[tuple[float, int, int, int, int, list[_Pair]]] = []
    seq = 0

    def push(children: list[_Child], total: int, parent: int, depth: int, score: float) -> None:
        nonlocal seq
        for count, tok, targets in children:
            if count < min_count:
                break  # children are sorted by descending count
            heapq.heappush(heap, (-score * count / total, seq, parent, depth, tok, targets))
            seq += 1

    tokens: list[int] = []
    parents: list[int] = []
    push(root_children, root_total, ROOT, 1, 1.0)
    while heap and len(tokens) < num_nodes:
        neg_score, _, parent, depth, tok, targets = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(tok)
        parents.append(parent)
        if depth < max_depth and len(tokens) < num_nodes:
            children, total = _children(targets)
            if total:
                push(children, total, node, depth + 1, -neg_score)
    return tokens, parents


def _draft_tree(tokens: list[int], parents: list[int]) -> DraftTree:
    return DraftTree(tokens=torch.tensor(tokens, dtype=torch.long),
                     parents=torch.tensor(parents, dtype=torch.long),
                     parent_probs=None, is_sampled=None,
                     sources=torch.full((len(tokens),), SUFFIX_SOURCE_ID, dtype=torch.int8))


def _as_ids(token_ids: Sequence[int] | torch.Tensor) -> Sequence[int]:
    """Python ints (tensor elements would hash by identity), checked: negative ids are reserved
    for the indexes' separators."""
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.tolist()
    if len(token_ids) and min(token_ids) < 0:
        raise FastdraftError("token ids must be >= 0 (negative ids are reserved for separators)")
    return token_ids
