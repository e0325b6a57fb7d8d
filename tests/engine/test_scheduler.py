"""Scheduling and slot bookkeeping, no model involved."""

from __future__ import annotations

import pytest

from fastdraft.engine.request import FinishReason, Request
from fastdraft.engine.sampling_params import SamplingParams
from fastdraft.engine.scheduler import Phase, Scheduler, SlotAllocator


def _req(i: int, prompt_len: int = 4, max_new: int = 3) -> Request:
    return Request(i, [7] * prompt_len, SamplingParams(max_new_tokens=max_new),
                   frozenset({1}), max_total_len=64)


def test_slots_lowest_first_and_no_double_free():
    slots = SlotAllocator(3)
    assert [slots.allocate() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(RuntimeError):
        slots.allocate()
    slots.free(1)
    with pytest.raises(RuntimeError):
        slots.free(1)
    assert slots.allocate() == 1


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
    batch = sched.schedule()  # slot 0 is free again: the waiting request is prefilled at once
    assert batch.phase is Phase.PREFILL and batch.requests == [reqs[2]] and reqs[2].slot == 0
    sched.postprocess(batch, [[5]], [[0.0]])
    batch = sched.schedule()
    assert batch.phase is Phase.DECODE and batch.requests == [reqs[1], reqs[2]]
    # token 1 = EOS for request 1; request 2 takes one of its two tokens and hits max_new_tokens
    finished = sched.postprocess(batch, [[1], [5, 5]], [[0.0], [0.0, 0.0]])
    assert finished == [reqs[1], reqs[2]]
    assert reqs[1].finish_reason is FinishReason.STOP and reqs[1].output_token_ids == [5, 1]
    assert reqs[2].output_token_ids == [5, 5]
    assert not sched.has_work and sched.slots.num_free == 2


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
    assert [r.index for r in sched.schedule().requests] == [0]
    assert [r.index for r in sched.schedule().requests] == [1]


def test_request_stops_at_cache_capacity():
    r = Request(0, [7] * 5, SamplingParams(max_new_tokens=100), frozenset(), max_total_len=7)
    assert not r.append(3, 0.0)
    assert r.append(3, 0.0) and r.finish_reason is FinishReason.LENGTH
