"""A producer thread adds (and spills) while a consumer thread samples and a third sets rewards:
no errors, no torn batches, capacity held throughout."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from fastdraft.databuffer import DataBuffer, load_spill, read_manifest
from tests.databuffer.helpers import make_sample, sample_bytes

NUM_STEPS, PER_STEP = 4, 30


@pytest.mark.parametrize("spill", [False, True])
def test_producer_consumer_and_rewards_in_threads(tmp_path: Path, spill: bool) -> None:
    capacity = sample_bytes(200)
    buf = DataBuffer(capacity, seed=0, spill_dir=tmp_path if spill else None)
    originals = {}
    errors: list[BaseException] = []
    done = threading.Event()
    consuming = threading.Event()  # the producer waits for it mid-way, so the two overlap

    def guarded(fn):
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # re-raised in the main thread below
                errors.append(e)
                done.set()
        return run

    @guarded
    def produce() -> None:
        for step in range(NUM_STEPS):
            for i in range(PER_STEP):
                s = make_sample(i, 3 + (7 * i) % 20, rl_step=step)
                originals[s.key] = s
                buf.add(s)
                assert buf.stats().num_bytes <= capacity
            buf.advance_step()
            if step == 0:
                assert consuming.wait(timeout=30)
        done.set()

    batches = []

    @guarded
    def consume() -> None:
        while not done.is_set() or len(batches) < 5:
            if errors:
                return
            batch = buf.sample(48)
            if batch is None:
                continue
            assert batch.num_tokens <= 48
            # every sequence in the row is one sample, whole and unmixed
            for n, key in enumerate(batch.keys):
                seg = batch.segment_ids[0] == n
                assert torch.equal(batch.input_ids[0, seg], originals[key].token_ids)
                assert torch.equal(batch.hidden[0, seg], originals[key].hidden)
            batches.append(batch.keys)
            consuming.set()

    @guarded
    def reward() -> None:
        while not done.is_set():
            for key in list(originals)[-10:]:
                buf.set_reward(key, float(key[1]))
            time.sleep(0.001)  # a reward trickle, not a spin on a shared CPU

    threads = [threading.Thread(target=f) for f in (produce, consume, reward)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads)
    stats = buf.stats()
    assert stats.num_bytes <= capacity and stats.step == NUM_STEPS
    assert stats.evicted_samples == NUM_STEPS * PER_STEP - stats.num_samples
    assert batches, "the consumer never got a batch"
    if spill:
        # every evicted sample reached disk, once, and its rewards agree with the buffer's view
        assert stats.spilled_samples == stats.evicted_samples
        assert len(read_manifest(tmp_path).records) == stats.evicted_samples
        resident = {s.key for s in buf.samples()}
        on_disk = {s.key: s for s in load_spill(tmp_path)}
        assert set(on_disk) | resident == set(originals) and not set(on_disk) & resident
        for key, s in on_disk.items():
            assert torch.equal(s.hidden, originals[key].hidden)
            assert s.reward in (None, float(key[1]))


def test_two_producers_and_flushes_spilling_at_once(tmp_path: Path) -> None:
    """Several threads writing to disk at once (evictions and flushes): no deadlock between the
    memory and the disk locks, and every sample ends up resident or on disk exactly once."""
    buf = DataBuffer(sample_bytes(60), spill_dir=tmp_path)
    errors: list[BaseException] = []

    def produce(worker: int) -> None:
        try:
            for i in range(40):
                buf.add(make_sample(i, 4 + i % 9, rl_step=worker))
                if i % 10 == 0:
                    buf.flush()
                buf.set_reward((1 - worker, i), 1.0)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=produce, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "deadlock"
    if errors:
        raise errors[0]
    buf.flush()
    records = read_manifest(tmp_path).records
    assert len(records) == len({r.key for r in records}) == 80
    assert buf.stats().spilled_samples == 80
