"""Continuous batching in plain Python: admit waiting requests into free KV slots, prefill them,
then decode every running request each step; finished requests free their slot at once.

Running requests always occupy slots 0..n-1, in slot order, so batch row b is slot b and the
model reads the cache through views (no gathers), padded up to a batch bucket with free slots.
When a request finishes, the request in the highest slot moves into the hole (one KV copy per
finished request: `take_moves`). No tensors here, so the policy is tested without a model."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from fastdraft.engine.request import Request

# What one more prefill chunk costs, in padded tokens (its fixed per-forward work). On the
# 2-core CPU, 256 prompts of the tiny recipe (6-240 tokens) took 2.0 s in 2 padded chunks;
# chunks closed at 1024 / 512 / 256 / 128: 1.0 / 0.92 / 0.87 / 0.81 s (4 / 5 / 7 / 10 chunks).
CHUNK_COST_TOKENS = 256


class Phase(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    """PREFILL: newly admitted requests in slots slot_start..; DECODE: every running request,
    request b in slot b."""

    phase: Phase
    requests: list[Request]

    @property
    def slot_start(self) -> int:
        return self.requests[0].slot


class SlotMove(NamedTuple):
    """A running request moved from slot src to slot dst (a lower one when compacting, any
    when put_first swaps); its first num_cells cache cells hold everything it has committed."""

    src: int
    dst: int
    num_cells: int


class Scheduler:
    def __init__(self, num_slots: int, max_prefill_tokens: int) -> None:
        self.num_slots = num_slots
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []          # running[i].slot == i
        self._moves: list[SlotMove] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_free(self) -> int:
        return self.num_slots - len(self.running)

    def schedule(self) -> ScheduledBatch:
        """Prefill first (new requests join the running batch as early as possible), else decode.

        A prefill is padded to its longest prompt, so it is budgeted by admitted x longest
        length, and the requests that fit in the free slots (first come, first served) are
        prefilled shortest prompt first, in chunks of similar lengths: a chunk closes when the
        next prompt would add more padding to it than a chunk of its own costs
        (CHUNK_COST_TOKENS). RL prompts are long-tailed too: in one padded chunk, 200 prompts of
        6-60 tokens beside 56 of up to 240 cost 3.5x their real tokens."""
        admitted: list[Request] = []
        num_fit = min(self.num_slots - len(self.running), len(self.waiting))
        if num_fit:
            candidates = sorted((self.waiting.popleft() for _ in range(num_fit)),
                                key=lambda r: r.prefill_len)
            longest = 0
            for request in candidates:   # ascending: each prompt is the chunk's longest
                n = request.prefill_len   # a migrated request re-prefills its answer too
                if admitted and ((len(admitted) + 1) * n > self.max_prefill_tokens
                                 or len(admitted) * (n - longest) > CHUNK_COST_TOKENS):
                    break
                longest = n
                request.slot = len(self.running) + len(admitted)
                admitted.append(request)
            self.waiting.extendleft(reversed(candidates[len(admitted):]))
        if admitted:
            self.running.extend(admitted)
            return ScheduledBatch(Phase.PREFILL, admitted)
        if not self.running:
            raise RuntimeError("schedule() called with no work")
        return ScheduledBatch(Phase.DECODE, list(self.running))

    def postprocess(self, batch: ScheduledBatch, token_ids: list[list[int]],
                    logprobs: list[list[float]]) -> list[Request]:
        """Appends each request's new tokens (one when decoding, accepted + bonus when
        speculating); returns the requests that finished. Their slots are freed and filled
        from the top (see take_moves)."""
        finished = [r for r, t, lp in zip(batch.requests, token_ids, logprobs) if r.extend(t, lp)]
        if finished:
            done = {id(r) for r in finished}
            keep = [r for r in self.running if id(r) not in done]
            num_kept = len(keep)
            used = {r.slot for r in keep}
            holes = [s for s in range(num_kept) if s not in used]
            movers = [r for r in keep if r.slot >= num_kept]
            for request, hole in zip(movers, holes, strict=True):
                self._moves.append(SlotMove(request.slot, hole, request.num_tokens))
                request.slot = hole
            keep.sort(key=lambda r: r.slot)
            self.running = keep
        return finished

    def put_first(self, first: list[Request]) -> list[SlotMove]:
        """Puts the running requests `first` in slots 0..len(first)-1 (the rows a split step
        speculates on), swapping each misplaced one with a misplaced request of the rest; returns
        the moves, to apply before the step (each swap is two moves, read before written)."""
        num_first, chosen = len(first), {id(r) for r in first}
        low = [r for r in self.running[:num_first] if id(r) not in chosen]
        high = [r for r in self.running[num_first:] if id(r) in chosen]
        moves = []
        for a, b in zip(low, high, strict=True):
            moves += [SlotMove(a.slot, b.slot, a.num_tokens), SlotMove(b.slot, a.slot,
                                                                      b.num_tokens)]
            a.slot, b.slot = b.slot, a.slot
        self.running.sort(key=lambda r: r.slot)
        return moves

    def take_moves(self) -> list[SlotMove]:
        """The slot moves since the last call: the engine copies each moved request's cache
        state (policy KV, drafter state, sampling settings) before the next step."""
        moves, self._moves = self._moves, []
        return moves
