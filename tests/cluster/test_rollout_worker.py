"""RolloutWorker's hand-off side, called directly (no Ray): a tail may be handed to a call the
worker has not begun yet (two workers that yield at the same moment: the second tail goes into
the call that finishes the first's), a call that ended takes nothing, and the tail's
completions are the ones it would have had where it started."""

from __future__ import annotations

from functools import partial

import pytest

from fastdraft.config.engine import SpecConfig
from fastdraft.engine import RolloutEngine, SamplingParams

pytest.importorskip("ray")   # the worker's methods carry Ray's concurrency annotations


def test_a_tail_handed_to_a_queued_call_is_finished_by_it(tiny_checkpoint, random_drafter):
    from fastdraft.workers.rollout_worker import RolloutWorker
    path, _ = tiny_checkpoint
    make = partial(RolloutEngine, path, max_batch_size=8, max_seq_len=80, drafter=random_drafter,
                   spec=SpecConfig(method="eagle", depth=2, topk=2, tokens_to_verify=4))
    prompts = [[5, 9, 11], [7, 3, 20, 4], [30, 31], [12, 13, 14, 15, 16], [40, 8, 2]]
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=5)
    want = make("cpu").generate(prompts, params, use_tqdm=False, stream_ids=list(range(5)))
    worker = RolloutWorker(make, "cpu", 0)
    first, _ = worker.generate(prompts[:3], params, [0, 1, 2], None, ticket=1, peers_busy=1,
                               yield_below=99)
    assert first.migrated and not first.completions   # yielded after its first step
    assert not worker.accept(first.migrated, ticket=1)   # that call has ended
    assert worker.accept(first.migrated, ticket=2)       # not begun yet: queued for it
    worker.peers(2, 0)   # news for the queued call: no peer left, so it must not yield
    second, _ = worker.generate(prompts[3:], params, [3, 4], None, ticket=2, peers_busy=1,
                                yield_below=99)
    assert not second.migrated
    got = sorted(second.completions, key=lambda c: c.index)
    assert [c.index for c in got] == list(range(5))
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
