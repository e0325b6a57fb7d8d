"""Tail consolidation: requests that leave one engine mid-generation and finish on another,
exactly as they would have finished where they started.

When few requests are left on a replica (its long tail), the replica is mostly idle padding:
`generate(..., yield_below=N)` stops there and hands its unfinished requests back as
`MigratedRequest`s (`engine.last_migrated`); the caller sends them to a replica that is still
busy (its running generate's `Inbox`) or to an idle one (`generate(..., resume=...)`).

Why the receiver continues exactly: everything a request's next token depends on travels with
it or is recomputed from what travels. Its random numbers are keyed by (its stream key `seed`,
draw site, token position) (engine/rng.py), never by its slot, batch or engine, so the record
carries the key its donor computed and the receiver draws the same uniforms at the same
positions. Its KV cache is rebuilt by a resumed prefill over prompt + o_1..o_{m-1}
(Request.prefill_token_ids): that prefill samples nothing, since its "first token" o_m is
already known (logprob recorded), and the proposer's on_prefill gets o_m as that token, so an
EAGLE drafter builds the state a fresh request of that prompt would have. The next step then
feeds root o_m at position len(prompt) + m - 1, the step the donor would have run. What can
differ is floating-point rounding (a prefill and the decode steps that wrote the donor's cache
reduce in different orders): a token flips only on a near-tie at that resolution.

What must match between donor and receiver for sampled requests: the same weights and the same
speculation (method, tree shape, no tuner, no length budget). A sampled token's draw site
depends on the step kind (a plain step draws from Stream.SAMPLE, a verify step from VERIFY and
BONUS, through the drafts), and a tuner or budget chooses the kind per batch, so with those
on, sampled answers depend on batch composition already, migration or not. Greedy requests
need only the same weights.

Indices: a migrated request keeps the index it left with; on the receiver it may equal one of
the receiver's own prompt indices (on_finish, on_hidden and Completion.index then repeat it).
A caller that routes by index gives migrated requests indices its own calls never use (e.g.
global rollout indices, or -1 - global index).

Hidden-state capture: a resumed request's prefill re-emits records for every position it
prefills, so the receiver's records of a migrated request cover its whole sequence (positions
0 .. L - 2, as capture.py pairs them). The caller must drop the donor's records of a migrated
request (they are a prefix of the receiver's, computed along another path).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fastdraft.engine.request import Request
from fastdraft.engine.sampling_params import SamplingParams
from fastdraft.engine.scheduler import Scheduler
from fastdraft.engine.spec.proposer import Proposer
from fastdraft.engine.spec.stats import SpecStats
from fastdraft.errors import FastdraftError


@dataclass(frozen=True, slots=True)
class MigratedRequest:
    """An unfinished request in transit (plain data: it pickles, so it crosses Ray actors).

    index: the caller's index of the request (its Completion and hidden-state records carry it
    on the receiver). seed: the request's stream key as make_requests computed it (not the
    params' seed): the receiver reproduces the stream whatever indices its own call uses.
    max_total_len: the donor's cap on prompt + answer (None: the receiver's max_seq_len), so
    a request finishes at the same length wherever it lands. A request that never ran (still
    queued on the donor) has no outputs and is prefilled and sampled as a fresh one."""

    index: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_logprobs: list[float]
    params: SamplingParams
    seed: int
    spec: SpecStats = field(default_factory=SpecStats)
    max_total_len: int | None = None

    def __post_init__(self) -> None:
        # Checked where the record is made, so a bad one fails its sender, not a receiver's
        # running generate.
        if not self.prompt_token_ids:
            raise FastdraftError(f"migrated request {self.index} has an empty prompt")
        if len(self.output_token_ids) != len(self.output_logprobs):
            raise FastdraftError(f"migrated request {self.index} has {len(self.output_token_ids)} "
                                 f"tokens but {len(self.output_logprobs)} logprobs")
        if len(self.output_token_ids) >= self.params.max_new_tokens:
            raise FastdraftError(f"migrated request {self.index} already holds max_new_tokens="
                                 f"{self.params.max_new_tokens} tokens: it has finished")

    @classmethod
    def of(cls, request: Request) -> MigratedRequest:
        """The record of an unfinished engine request (lists copied: the donor's request may
        still be referenced by its caller)."""
        assert request.finish_reason is None, "only unfinished requests migrate"
        return cls(request.index, list(request.prompt_token_ids),
                   list(request.output_token_ids), list(request.output_logprobs),
                   request.params, request.seed, copy.deepcopy(request.spec),
                   request.max_total_len)

    def to_request(self, vocab_size: int, max_seq_len: int,
                   eos_token_ids: frozenset[int]) -> Request:
        """The receiver's engine request. Stop tokens are the receiver's own (same model, same
        EOS); the cap is the donor's unless the receiver's cache is smaller (then a request
        that would have run past it finishes with LENGTH there: not what the donor would
        have done). The record itself is never mutated, so it can be sent again."""
        tokens = self.prompt_token_ids + self.output_token_ids
        cap = min(max_seq_len, self.max_total_len or max_seq_len)
        if len(tokens) >= cap:
            raise FastdraftError(f"migrated request {self.index} holds {len(tokens)} tokens; this "
                                 f"engine's cap is {cap} (prompt + answer)")
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise FastdraftError(f"migrated request {self.index} has token ids outside "
                                 f"[0, {vocab_size}): {bad[:5]}")
        p = self.params
        stop = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else eos_token_ids)
        if self.output_token_ids and self.output_token_ids[-1] in stop:
            raise FastdraftError(f"migrated request {self.index} ends with a stop token: it has "
                                 "finished")
        return Request(self.index, list(self.prompt_token_ids), p, stop, cap, self.seed,
                       output_token_ids=list(self.output_token_ids),
                       output_logprobs=list(self.output_logprobs),
                       spec=copy.deepcopy(self.spec))


class Inbox:
    """Where other threads hand migrated requests to one running `generate` (thread-safe).

    The generate drains it at every step boundary and closes it when it ends (finished or
    yielded), under the same lock as `put`: a put either lands before the close, and the
    generate then runs those requests (or, if it yielded, hands them back in
    `engine.last_migrated`), or it returns False and the caller sends them elsewhere; a request
    is never stranded. One Inbox serves one generate call. Across Ray actors, the receiving
    actor owns the Inbox and exposes `put` as a method on a concurrent actor thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[MigratedRequest] = []
        self._closed = False

    def put(self, requests: list[MigratedRequest]) -> bool:
        """Queues requests for the owning generate; False (nothing queued) once it closed."""
        with self._lock:
            if self._closed:
                return False
            self._items.extend(requests)
            return True

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    def take(self, close_if_empty: bool = False) -> list[MigratedRequest]:
        """Everything queued so far. close_if_empty: the generate has no work left, so an
        empty inbox closes in the same critical section (no put can slip in between)."""
        with self._lock:
            items, self._items = self._items, []
            if close_if_empty and not items:
                self._closed = True
            return items

    def close(self) -> list[MigratedRequest]:
        """Closes the inbox; returns what was queued and not yet taken."""
        with self._lock:
            self._closed = True
            items, self._items = self._items, []
            return items


class Handoff:
    """The migration side of one generate call: admitting resumed and inbox requests, deciding
    when to yield, and handing the unfinished requests back. Kept out of engine.py so the
    generate loop reads as it did without migration."""

    def __init__(self, vocab_size: int, max_seq_len: int, eos_token_ids: frozenset[int],
                 inbox: Inbox | None = None, yield_below: int = 0,
                 should_yield: Callable[[], bool] | None = None) -> None:
        if inbox is not None and inbox.closed:
            raise FastdraftError("this Inbox is closed: one Inbox serves one generate call")
        if yield_below < 0:
            raise FastdraftError(f"yield_below must be >= 0, got {yield_below}")
        self._make = (vocab_size, max_seq_len, eos_token_ids)
        self.inbox, self.yield_below = inbox, yield_below
        self.should_yield = should_yield or (lambda: True)

    def receive(self, migrated: list[MigratedRequest]) -> list[Request]:
        return [m.to_request(*self._make) for m in migrated]

    def refill(self, scheduler: Scheduler) -> list[Request]:
        """At a step boundary: the inbox's requests join the scheduler (admitted like new ones,
        resumed-prefilled). With no work left and nothing queued, the inbox closes here."""
        if self.inbox is None:
            return []
        arrivals = self.receive(self.inbox.take(close_if_empty=not scheduler.has_work))
        for request in arrivals:
            scheduler.add(request)
        return arrivals

    def yields(self, scheduler: Scheduler) -> bool:
        """Asked after each step (never before the first: a call that yields makes progress
        first, so a tail cannot bounce between engines without moving): fewer than yield_below
        requests left (but some), and the caller agrees. should_yield is asked only then, at
        every such boundary until it says yes."""
        left = len(scheduler.unfinished)
        return 0 < left < self.yield_below and self.should_yield()

    def finish(self, scheduler: Scheduler, proposer: Proposer) -> list[MigratedRequest]:
        """The end of the call: closes the inbox and returns every request it did not finish
        (none when it ran to the end), in index order. The proposer forgets the running ones
        as if they had finished (frees per-request state; a suffix drafter's window gains
        their partial answer, only a draft source)."""
        for request in scheduler.running:
            proposer.on_finish(request)
        left = [MigratedRequest.of(r) for r in scheduler.unfinished]
        if self.inbox is not None:
            left += self.inbox.close()
        return sorted(left, key=lambda m: m.index)

    @staticmethod
    def prefill_views(requests: list[Request]) -> list[Request]:
        """What a proposer's on_prefill sees: a resumed request as the fresh request whose
        prompt is everything it prefilled (the proposer then builds exactly that request's
        state; EAGLE reads only the prompt)."""
        return [r if not r.output_token_ids else Request(
            r.index, r.prefill_token_ids, r.params, r.stop_token_ids, r.max_total_len, r.seed,
            r.slot) for r in requests]

    @staticmethod
    def first_tokens(requests: list[Request], sampled: torch.Tensor) -> torch.Tensor:
        """A prefill's first tokens [m]: the sampled one of a fresh request, the known last
        answer token of a resumed one (its sample is discarded: the donor drew that token)."""
        known = [r.output_token_ids[-1] if r.output_token_ids else -1 for r in requests]
        if all(t < 0 for t in known):
            return sampled
        known_t = torch.tensor(known, device=sampled.device, dtype=sampled.dtype)
        return torch.where(known_t >= 0, known_t, sampled)
