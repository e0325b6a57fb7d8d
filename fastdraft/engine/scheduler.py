"""Continuous batching in plain Python: admit waiting requests into free slots (and, with a
bounded paged KV cache, free blocks), prefill them, then decode every running request each
step; finished requests free their slot at once, preempted ones wait at the head of the queue.

Running requests always occupy slots 0..n-1, in slot order, so batch row b is slot b (its
per-slot state, its block table or static KV region), padded up to a batch bucket with free
slots. When a request leaves, the request in the highest slot moves into the hole (one move per
hole: `take_moves`; the paged cache moves a table row, static slots copy K/V). No tensors
here, so the policy is tested without a model."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple, Protocol

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
    request b in slot b. chunk (PREFILL of a staged prompt, see Staged): the positions lo..hi-1
    this step computes; the requests hold slots only from the last chunk on."""

    phase: Phase
    requests: list[Request]
    chunk: tuple[int, int] | None = None

    @property
    def slot_start(self) -> int:
        return self.requests[0].slot


class SlotMove(NamedTuple):
    """A running request moved from slot src to slot dst (a lower one when compacting, any
    when put_first swaps); its first num_cells cache cells hold everything it has committed."""

    src: int
    dst: int
    num_cells: int


@dataclass(slots=True)
class Staged:
    """A prompt longer than a prefill chunk (a long prompt, or the re-prefill of a preempted or
    migrated request's prompt + answer), prefilled a chunk per step with decode steps between:
    its requests (one prompt: a request, or a GRPO group's equal prompts) and the cells done."""

    requests: list[Request]
    length: int
    done: int = 0


class KVBlocks(Protocol):
    """What admission asks of a paged KV cache (engine/paged_kv.py)."""

    @property
    def num_free(self) -> int: ...

    def blocks_for(self, num_cells: int) -> int: ...


class Scheduler:
    def __init__(self, num_slots: int, max_prefill_tokens: int,
                 kv: KVBlocks | None = None, chunk_tokens: int = 0) -> None:
        """kv: a paged cache's free blocks bound admission too (None: slots alone).
        chunk_tokens > 0: a prompt longer than that is prefilled in chunks of it (Staged)."""
        self.num_slots = num_slots
        self.max_prefill_tokens = max_prefill_tokens
        self.kv = kv
        self.chunk_tokens = chunk_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []          # running[i].slot == i
        self.staged: Staged | None = None
        self._decode_next = False   # after a chunk the running requests take a step
        self._moves: list[SlotMove] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.staged)

    @property
    def unfinished(self) -> list[Request]:
        """Every request not finished: running, staged, then waiting."""
        staged = self.staged.requests if self.staged is not None else []
        return [*self.running, *staged, *self.waiting]

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
        6-60 tokens beside 56 of up to 240 cost 3.5x their real tokens.

        A prompt longer than chunk_tokens is staged (with its group's equal prompts): a chunk a
        step, the running requests decoding between chunks, nothing else admitted meanwhile.

        With a paged cache, the admitted requests' blocks (a group's equal prompts count once)
        and one block each to decode into must be free (`_blocks_to_admit`)."""
        if self.staged is not None:
            if self.running and self._decode_next:
                self._decode_next = False
                return ScheduledBatch(Phase.DECODE, list(self.running))
            return self._next_chunk()
        admitted: list[Request] = []
        num_fit = min(self.num_slots - len(self.running), len(self.waiting))
        staging = False
        if num_fit:
            candidates = sorted((self.waiting.popleft() for _ in range(num_fit)),
                                key=lambda r: r.prefill_len)
            longest, blocks, seen = 0, 0, set()
            for request in candidates:   # ascending: each prompt is the chunk's longest
                n = request.prefill_len   # a migrated request re-prefills its answer too
                long = 0 < self.chunk_tokens < n
                if staging:   # only the staged prompt's equals join it
                    if request.prefill_token_ids != admitted[0].prefill_token_ids:
                        break
                elif admitted and (long or (len(admitted) + 1) * n > self.max_prefill_tokens
                                   or len(admitted) * (n - longest) > CHUNK_COST_TOKENS):
                    break
                blocks += self._blocks_to_admit(request, seen)
                # Room for the running requests to grow a block each: admitting into the last
                # free blocks would only preempt someone at the next step.
                if self.kv is not None and blocks + len(self.running) > self.kv.num_free:
                    break
                longest, staging = n, staging or long
                if not staging:
                    request.slot = len(self.running) + len(admitted)
                admitted.append(request)
            self.waiting.extendleft(reversed(candidates[len(admitted):]))
        if staging:
            self.staged = Staged(admitted, longest)
            return self._next_chunk()
        if admitted:
            self.running.extend(admitted)
            return ScheduledBatch(Phase.PREFILL, admitted)
        if not self.running:
            if self.waiting and self.kv is not None:   # a cache under one request: refused
                raise RuntimeError(f"no request fits the free KV blocks ({self.kv.num_free})")
            raise RuntimeError("schedule() called with no work")
        return ScheduledBatch(Phase.DECODE, list(self.running))

    def _next_chunk(self) -> ScheduledBatch:
        """The staged prompt's next chunk; at its last, its requests take slots and run."""
        staged = self.staged
        assert staged is not None
        lo = staged.done
        staged.done = hi = min(lo + self.chunk_tokens, staged.length)
        if hi == staged.length:
            for request in staged.requests:
                request.slot = len(self.running)
                self.running.append(request)
            self.staged = None
        else:
            self._decode_next = True
        return ScheduledBatch(Phase.PREFILL, list(staged.requests), chunk=(lo, hi))

    def _blocks_to_admit(self, request: Request, seen: set[tuple[int, ...]]) -> int:
        """Blocks a request takes when admitted, plus one to decode into: a prompt already
        admitted in this batch shares its blocks (engine/prefix_share.py) and needs only the
        copy of its last, partly filled block."""
        if self.kv is None:
            return 0
        tokens = tuple(request.prefill_token_ids)
        if tokens in seen:
            return 2
        seen.add(tokens)
        return self.kv.blocks_for(len(tokens)) + 1

    def preempt(self, request: Request) -> None:
        """A running request gives its slot (and the caller its KV blocks) back and waits at
        the head of the queue; it resumes by recomputing prompt + answer (a resumed prefill,
        engine/migration.py), continuing as it would have without the break."""
        self._remove([request])
        request.slot = -1
        request.preemptions += 1
        self.waiting.appendleft(request)

    def postprocess(self, batch: ScheduledBatch, token_ids: list[list[int]],
                    logprobs: list[list[float]]) -> list[Request]:
        """Appends each request's new tokens (one when decoding, accepted + bonus when
        speculating); returns the requests that finished. Their slots are freed and filled
        from the top (see take_moves)."""
        finished = [r for r, t, lp in zip(batch.requests, token_ids, logprobs) if r.extend(t, lp)]
        self._remove(finished)
        return finished

    def _remove(self, leaving: list[Request]) -> None:
        """Running requests leave; the highest slots fill the holes (take_moves)."""
        if not leaving:
            return
        done = {id(r) for r in leaving}
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
