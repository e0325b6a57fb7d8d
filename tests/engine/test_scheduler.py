"""Scheduling and slot bookkeeping, no model involved."""

from __future__ import annotations

from fastdraft.engine.request import FinishReason, Request
from fastdraft.engine.sampling_params import SamplingParams
from fastdraft.engine.scheduler import Phase, Scheduler, SlotMove


def _req(i: int, prompt_len: int = 4, max_new: int = 3) -> Request:
    return Request(i, [7] * prompt_len, SamplingParams(max_new_tokens=max_new),
                   frozenset({1}), max_total_len=64)


def test_finished_requests_leave_the_running_batch_dense():
    """Running requests always sit in slots 0..n-1: a hole left by a finished request is filled
    by the request in the highest slot (one move per hole), and the batch stays in slot order."""
    sched = Scheduler(num_slots=5, max_prefill_tokens=1000)
    reqs = [_req(i, max_new=n) for i, n in enumerate([1, 9, 2, 9, 9])]
    for r in reqs:
        sched.add(r)
    batch = sched.schedule()
    assert [r.slot for r in batch.requests] == [0, 1, 2, 3, 4] and batch.slot_start == 0
    assert sched.postprocess(batch, [[5]] * 5, [[0.0]] * 5) == [reqs[0]]
    assert sched.take_moves() == [SlotMove(4, 0, 5)] and sched.take_moves() == []
    assert [r.index for r in sched.running] == [4, 1, 2, 3]
    assert [r.slot for r in sched.running] == [0, 1, 2, 3]
    batch = sched.schedule()
    assert [r.index for r in batch.requests] == [4, 1, 2, 3]
    # request 2 (slot 2) finishes: request 3 (slot 3) moves down
    sched.postprocess(batch, [[5]] * 4, [[0.0]] * 4)
    assert sched.take_moves() == [SlotMove(3, 2, 6)]
    assert [(r.index, r.slot) for r in sched.running] == [(4, 0), (1, 1), (3, 2)]
    # the highest slot finishing moves nothing
    batch = sched.schedule()
    reqs[3].params = SamplingParams(max_new_tokens=3)
    sched.postprocess(batch, [[5]] * 3, [[0.0]] * 3)
    assert sched.take_moves() == [] and [r.slot for r in sched.running] == [0, 1]


def test_put_first_swaps_the_chosen_requests_into_the_lowest_slots():
    """A split step's speculating rows go first: each chosen request above the cut swaps with
    an unchosen one below it (two moves per swap), those already in place stay."""
    sched = Scheduler(num_slots=6, max_prefill_tokens=1000)
    reqs = [_req(i, prompt_len=2 + i) for i in range(6)]
    for r in reqs:
        sched.add(r)
    sched.schedule()
    moves = sched.put_first([reqs[5], reqs[1], reqs[3]])
    assert sorted(moves) == sorted([SlotMove(0, 3, 2), SlotMove(3, 0, 5),
                                    SlotMove(2, 5, 4), SlotMove(5, 2, 7)])
    assert {r.index for r in sched.running[:3]} == {1, 3, 5}
    assert [r.slot for r in sched.running] == list(range(6))
    assert sched.put_first([reqs[5], reqs[1], reqs[3]]) == []   # already first
    assert sched.take_moves() == []                 # applied by the caller, not queued


def test_prefill_then_decode_and_refill_freed_slots():
    sched = Scheduler(num_slots=2, max_prefill_tokens=1000)
    reqs = [_req(0, max_new=1), _req(1, max_new=3), _req(2, max_new=2)]
    for r in reqs:
        sched.add(r)
    batch = sched.schedule()
    assert batch.phase is Phase.PREFILL and batch.requests == reqs[:2]
    assert [r.slot for r in reqs[:2]] == [0, 1]
    finished = sched.postprocess(batch, [[5], [5]], [[-0.1], [-0.2]])
    assert finished == [reqs[0]] and reqs[0].finish_reason is FinishReason.LENGTH
    assert sched.take_moves() == [SlotMove(1, 0, 5)]  # request 1 fills the hole in slot 0
    batch = sched.schedule()  # a slot is free again: the waiting request is prefilled at once
    assert batch.phase is Phase.PREFILL and batch.requests == [reqs[2]] and reqs[2].slot == 1
    sched.postprocess(batch, [[5]], [[0.0]])
    batch = sched.schedule()
    assert batch.phase is Phase.DECODE and batch.requests == [reqs[1], reqs[2]]
    # token 1 = EOS for request 1; request 2 takes one of its two tokens and hits max_new_tokens
    finished = sched.postprocess(batch, [[1], [5, 5]], [[0.0], [0.0, 0.0]])
    assert finished == [reqs[1], reqs[2]]
    assert reqs[1].finish_reason is FinishReason.STOP and reqs[1].output_token_ids == [5, 1]
    assert reqs[2].output_token_ids == [5, 5]
    assert not sched.has_work and sched.num_free == 2


def test_prefill_token_budget_splits_admission():
    sched = Scheduler(num_slots=8, max_prefill_tokens=10)
    for i in range(4):
        sched.add(_req(i, prompt_len=4))
    assert len(sched.schedule().requests) == 2  # 3 * 4 padded tokens > 10
    assert len(sched.schedule().requests) == 2
    assert sched.schedule().phase is Phase.DECODE


def test_a_prompt_longer_than_the_budget_still_runs_alone():
    sched = Scheduler(num_slots=4, max_prefill_tokens=10)
    sched.add(_req(0, prompt_len=30))
    sched.add(_req(1, prompt_len=2))
    assert [r.index for r in sched.schedule().requests] == [1]   # shortest first
    assert [r.index for r in sched.schedule().requests] == [0]


def test_prefill_chunks_go_shortest_first_and_pad_little():
    """A long-tailed prompt mix: chunks of similar lengths (padded tokens close to the real
    ones), while admission stays first come first served across the slot limit."""
    sched = Scheduler(num_slots=6, max_prefill_tokens=24)
    lengths = [20, 2, 3, 18, 2, 4, 3, 2]
    for i, n in enumerate(lengths):
        sched.add(_req(i, prompt_len=n))
    chunks = []
    while (batch := sched.schedule()).phase is Phase.PREFILL:
        chunks.append([r.index for r in batch.requests])
    assert chunks == [[1, 4, 2, 5], [3], [0]]   # requests 6 and 7 wait for a free slot
    assert [r.slot for r in sched.running] == list(range(6))
    padded = sum(len(c) * max(lengths[i] for i in c) for c in chunks)
    assert padded == 4 * 4 + 18 + 20   # FIFO chunks would pad 2 + 4 = 6 prompts to 20


def test_request_stops_at_cache_capacity():
    r = Request(0, [7] * 5, SamplingParams(max_new_tokens=100), frozenset(), max_total_len=7)
    assert not r.append(3, 0.0)
    assert r.append(3, 0.0) and r.finish_reason is FinishReason.LENGTH


class _Blocks:
    """A paged cache's free blocks as admission sees them (engine/paged_kv.py)."""

    def __init__(self, num_free: int, block_size: int = 4) -> None:
        self.num_free, self.block_size = num_free, block_size

    def blocks_for(self, num_cells: int) -> int:
        return -(-num_cells // self.block_size)


def test_admission_stops_at_the_free_kv_blocks_and_a_group_counts_its_prompt_once():
    sched = Scheduler(num_slots=16, max_prefill_tokens=1000, kv=_Blocks(num_free=12))
    group = [Request(i, [9] * 10, SamplingParams(max_new_tokens=3), frozenset({1}), 64)
             for i in range(4)]   # 3 blocks + 1 to decode, then 2 each (the copied last block)
    loner = _req(4, prompt_len=10)   # 3 + 1 more: over the 12 free
    for r in [*group, loner]:
        sched.add(r)
    batch = sched.schedule()
    assert [r.index for r in batch.requests] == [0, 1, 2, 3]
    assert list(sched.waiting) == [loner]


def test_a_preempted_request_waits_first_and_the_rest_stay_dense():
    sched = Scheduler(num_slots=4, max_prefill_tokens=1000)
    reqs = [_req(i, max_new=9) for i in range(4)]
    for r in reqs:
        sched.add(r)
    sched.schedule()
    sched.add(later := _req(9))
    sched.preempt(reqs[1])
    assert sched.take_moves() == [SlotMove(3, 1, 4)]
    assert [(r.index, r.slot) for r in sched.running] == [(0, 0), (3, 1), (2, 2)]
    assert list(sched.waiting) == [reqs[1], later] and reqs[1].preemptions == 1
    assert sched.schedule().requests == [reqs[1]]   # back in the freed slot, first in line
