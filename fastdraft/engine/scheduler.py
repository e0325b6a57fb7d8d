"""Continuous batching in plain Python: admit waiting requests into free KV slots, prefill them,
then decode every running request one token per step; finished requests free their slot at once.
No tensors here, so the policy is tested without a model."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import StrEnum

from fastdraft.engine.request import Request


class Phase(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    phase: Phase
    requests: list[Request]


class SlotAllocator:
    """Hands out KV-cache slots lowest first, so a full batch tends to use consecutive slots (the
    model then reads the cache through a view instead of a gather)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free KV slot")
        self._free.sort()
        return self._free.pop(0)

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"slot {slot} freed twice or out of range")
        self._free.append(slot)


class Scheduler:
    def __init__(self, num_slots: int, max_prefill_tokens: int) -> None:
        self.slots = SlotAllocator(num_slots)
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Prefill first (new requests join the running batch as early as possible), else decode."""
        admitted: list[Request] = []
        # Prefill is padded to the longest prompt, so budget by admitted * longest length.
        longest = 0
        while self.waiting and self.slots.num_free:
            candidate_len = max(longest, len(self.waiting[0].prompt_token_ids))
            if admitted and (len(admitted) + 1) * candidate_len > self.max_prefill_tokens:
                break
            request = self.waiting.popleft()
            request.slot = self.slots.allocate()
            admitted.append(request)
            longest = candidate_len
        if admitted:
            self.running.extend(admitted)
            return ScheduledBatch(Phase.PREFILL, admitted)
        if not self.running:
            raise RuntimeError("schedule() called with no work")
        return ScheduledBatch(Phase.DECODE, list(self.running))

    def postprocess(self, batch: ScheduledBatch, token_ids: list[list[int]],
                    logprobs: list[list[float]]) -> list[Request]:
        """Appends each request's new tokens (one when decoding, accepted + bonus when
        speculating); returns the requests that finished (their slots are freed)."""
        finished = [r for r, t, lp in zip(batch.requests, token_ids, logprobs) if r.extend(t, lp)]
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
            for request in finished:
                self.slots.free(request.slot)
        return finished
