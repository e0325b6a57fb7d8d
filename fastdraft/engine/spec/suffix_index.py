"""Token indexes behind the suffix drafter: an online suffix automaton with bounded-depth
occurrence counts, and a per-prompt index of recent rollouts made of such automata.

Why a suffix automaton (SAM): it is built online in amortised O(1) per token (no rebuild when a
rollout arrives), has at most 2n states, and a request can keep a matching cursor into it that
finds the longest suffix of its context occurring in the index in amortised O(1) per new token.
The continuations of a matched string u are the automaton's transitions out of u's state, and the
number of occurrences of u + path is the end-position count of the state that path leads to.

Counts are only kept exact for states holding some string of length <= `count_depth` (the
longest matched suffix plus the deepest draft). A new token must add 1 to every state on its
suffix-link chain; restricting that to the short states bounds the walk by count_depth even on
degenerate text ("aaaa..." or a looping answer), where the full chain grows with the text.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

ROOT_STATE = 0
GEN_START = -1
"""Marker between a prompt and its generated tokens: rollouts are stored as [GEN_START, *tokens],
and a request's context is prompt + [GEN_START] + generated, so the first draft after the prompt
comes from the first tokens of earlier rollouts (and matches are anchored at the answer start)."""


class SuffixAutomaton:
    """Online suffix automaton over one token stream (tokens are ints; negatives are separators
    that callers never propose).

    State arrays (index = state id, 0 = root = the empty string):
      length[s]: longest string in s; link[s]: suffix link (-1 for the root);
      nxt[s]: token -> state; cnt[s]: number of end positions of s's strings (exact only for
      states with a string of length <= count_depth, i.e. length[link[s]] < count_depth);
      anc[s]: a state on s's suffix-link chain such that every state strictly below it on the
      chain has no string of length <= count_depth (where a count walk may start).
    """

    __slots__ = ("anc", "cnt", "count_depth", "last", "length", "link", "num_tokens", "nxt")

    def __init__(self, count_depth: int) -> None:
        self.count_depth = count_depth
        self.length: list[int] = [0]
        self.link: list[int] = [-1]
        self.nxt: list[dict[int, int]] = [{}]
        self.cnt: list[int] = [0]
        self.anc: list[int] = [ROOT_STATE]
        self.last = ROOT_STATE
        self.num_tokens = 0

    @property
    def num_states(self) -> int:
        return len(self.length)

    def extend(self, token_ids: Iterable[int]) -> None:
        for tok in token_ids:
            self.append(tok)

    def append(self, tok: int) -> None:
        """Standard online SAM extension, plus the bounded count update (amortised O(1) states
        touched by the construction, at most count_depth + 1 by the count walk)."""
        length, link, nxt, cnt, anc = self.length, self.link, self.nxt, self.cnt, self.anc
        depth = self.count_depth
        cur = len(length)
        length.append(length[self.last] + 1)
        link.append(ROOT_STATE)
        nxt.append({})
        cnt.append(0)
        anc.append(cur)
        p = self.last
        while p != -1 and tok not in nxt[p]:
            nxt[p][tok] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][tok]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # split q: the clone takes q's strings of length <= length[p] + 1
                clone = len(length)
                q_link = link[q]
                length.append(length[p] + 1)
                link.append(q_link)
                nxt.append(dict(nxt[q]))
                cnt.append(cnt[q])  # exact whenever the clone is short (then q was short too)
                anc.append(clone if length[q_link] < depth else anc[q_link])
                while p != -1 and nxt[p].get(tok) == q:
                    nxt[p][tok] = clone
                    p = link[p]
                link[q] = clone
                link[cur] = clone
        parent = link[cur]
        start = cur if length[parent] < depth else anc[parent]
        while start != ROOT_STATE and length[link[start]] >= depth:  # skip stale long states
            start = link[start]
        anc[cur] = start
        if start != cur:
            anc[parent] = start  # path compression: later chains through parent start here too
        s = start
        while s > ROOT_STATE:
            cnt[s] += 1
            s = link[s]
        self.last = cur
        self.num_tokens += 1

    def step(self, state: int, match_len: int, tok: int, max_len: int) -> tuple[int, int]:
        """Matching-statistics step: (state, match_len) is the longest suffix (<= max_len) of a
        text that occurs here; returns the same for the text + [tok]. Amortised O(1)."""
        nxt, link, length = self.nxt, self.link, self.length
        while state != ROOT_STATE and tok not in nxt[state]:
            state = link[state]
            match_len = length[state]
        nxt_state = nxt[state].get(tok)
        if nxt_state is None:
            return ROOT_STATE, 0
        state, match_len = nxt_state, match_len + 1
        if match_len > max_len:
            match_len = max_len
            while length[link[state]] >= match_len:
                state = link[state]
        return state, match_len

    def match(self, token_ids: Sequence[int], max_len: int) -> tuple[int, int]:
        """(state, length) of the longest suffix of token_ids (<= max_len) occurring here."""
        state, match_len = ROOT_STATE, 0
        for tok in token_ids[-max_len:] if max_len else ():
            state, match_len = self.step(state, match_len, tok, max_len)
        return state, match_len

    def shorten(self, state: int, match_len: int) -> int:
        """The state holding the suffix of length match_len of a string in `state`."""
        link, length = self.link, self.length
        while length[link[state]] >= match_len:
            state = link[state]
        return state

    def repeated_suffix(self, max_len: int) -> tuple[int, int]:
        """(state, length) of the longest suffix (<= max_len) of the whole stream that also
        ends at an earlier position: the suffix link of the last state. O(1) amortised."""
        if self.last == ROOT_STATE:
            return ROOT_STATE, 0
        state = self.link[self.last]
        match_len = min(self.length[state], max_len)
        if match_len == 0:
            return ROOT_STATE, 0
        return self.shorten(state, match_len), match_len


@dataclass(slots=True, eq=False)
class Segment:
    """Rollouts of one RL step (or part of one, when they exceed the segment size) in one
    automaton. Only the newest segment of a prompt receives rollouts; `version` changes with each,
    which tells request cursors into it to re-match."""

    serial: int
    step: int
    sam: SuffixAutomaton
    num_tokens: int = 0      # rollout tokens stored (framing markers not counted)
    num_rollouts: int = 0
    version: int = 0
    # The rollouts as inserted (4 bytes a token, next to the automaton's far larger states):
    # a resumed run rebuilds the same window from them.
    rollouts: list[array] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class PromptIndex:
    """Recent rollouts of one prompt, as segments oldest first.

    Eviction drops whole segments, so it never rebuilds an automaton: the window drops segments of
    old steps, and the token cap drops the oldest segments until the rollout tokens fit. A new
    segment opens when the step changes or the newest would exceed segment_tokens, so one
    eviction drops at most ~segment_tokens tokens more than strictly needed.
    """

    count_depth: int
    max_tokens: int
    segment_tokens: int
    segments: list[Segment] = field(default_factory=list)
    num_tokens: int = 0

    def add(self, token_ids: Sequence[int], step: int, serial: int) -> None:
        """Insert one rollout (truncated to max_tokens), then evict to the cap. `serial`
        identifies a segment opened for it, unique across prompt indexes."""
        token_ids = token_ids[: self.max_tokens]
        newest = self.segments[-1] if self.segments else None
        if (newest is None or newest.step != step
                or newest.num_tokens + len(token_ids) > self.segment_tokens):
            newest = Segment(serial=serial, step=step, sam=SuffixAutomaton(self.count_depth))
            self.segments.append(newest)
        newest.rollouts.append(array("i", token_ids))
        sam = newest.sam
        sam.append(GEN_START)
        sam.extend(token_ids)
        sam.append(_terminator(sam))
        newest.num_tokens += len(token_ids)
        newest.num_rollouts += 1
        newest.version += 1
        self.num_tokens += len(token_ids)
        while self.num_tokens > self.max_tokens and len(self.segments) > 1:
            self._drop_oldest()

    def evict_steps_before(self, min_step: int) -> None:
        """Drop every segment whose step is < min_step."""
        kept = [seg for seg in self.segments if seg.step >= min_step]
        self.segments = kept
        self.num_tokens = sum(seg.num_tokens for seg in kept)

    def _drop_oldest(self) -> None:
        self.num_tokens -= self.segments.pop(0).num_tokens


def _terminator(sam: SuffixAutomaton) -> int:
    """A separator used once per automaton (-2, -3, ...): no match or count crosses a rollout
    end, and GEN_START is never preceded by anything a context can contain."""
    return -2 - sam.num_tokens
