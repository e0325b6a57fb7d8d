"""DataBuffer: the hidden states of finished rollouts, from which the spot trainer samples
drafter training batches.

The engine's sink calls `add` as requests finish (producer thread); the trainer calls `sample`
(consumer thread); the RL loop calls `advance_step` at each step boundary and `set_reward` once
rewards are known. Memory is bounded by a byte capacity that is never exceeded: adding evicts the
oldest samples first (to the spill directory, when there is one). A rollout longer than
max_sample_tokens, or larger than the whole capacity, is held as windows (windows.py), each a
sample of its own sharing the rollout's reward, never refused.

Concurrency: one lock guards the in-memory state, held only for bookkeeping; batches are packed
and files written outside it, so a spill never stalls the trainer's `sample`. Samples are
immutable (a reward replaces the record), so a batch being packed cannot change underneath.
"""

from __future__ import annotations

import math
import random
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from fastdraft.databuffer.offset_sampler import select_offset
from fastdraft.databuffer.packing import PackedBatch, pack, pack_rows
from fastdraft.databuffer.sample import Sample, SampleKey, WindowKey
from fastdraft.databuffer.spill import SpillStore, load_records
from fastdraft.databuffer.windows import cut_windows, tokens_within
from fastdraft.errors import FastdraftError


@dataclass(frozen=True, slots=True)
class BufferStats:
    num_samples: int
    num_bytes: int
    num_tokens: int
    capacity_bytes: int
    step: int
    current_samples: int     # added during the current step
    previous_samples: int    # added during the step before
    evicted_samples: int     # since construction
    spilled_samples: int     # written to the spill directory by this buffer
    cut_samples: int = 0     # rollouts added as several windows, since construction


@dataclass(frozen=True, slots=True)
class _Claim:
    """Samples (with the step each was added in) a thread has claimed to write to disk."""

    items: list[tuple[Sample, int]]
    step: int
    locked: bool  # whether the claiming thread holds _io_lock


@dataclass(slots=True)
class _Entry:
    sample: Sample
    step: int  # the buffer step during which it was added


class DataBuffer:
    """Samples held in memory, at most capacity_bytes of tensor data (Sample.nbytes).

    offset_mix: share of each batch's token budget given first to the previous step's longest
    samples (see offset_sampler); tail_fraction: how much of the previous step counts as its
    longest samples. seed: `sample` draws from one random.Random(seed), so a given sequence of
    calls yields the same batches. spill_dir: evicted samples, and all resident ones on `flush`,
    go to safetensors shards there (see spill.py); `DataBuffer.restore` reads them back.
    max_sample_tokens: a longer rollout is added as windows of at most this many tokens (None:
    only one larger than the capacity is cut, to windows that fit it). window_context: tokens
    each window but a rollout's first leads with, attended to and not scored (windows.py; at
    most half a window). holdout_every: every this many rollouts of a step (0: none) are held
    out: never sampled for training, they are what `held_out` returns, on which a trained
    drafter is compared with the one it would replace (trainer/spot.py). A held-out rollout
    is never cut into windows (a window lacks the prompt, so it would score drafting without
    the context inference has): it is kept whole, or its first holdout_tokens tokens (None:
    max_sample_tokens), every scored pair with all its context.
    """

    def __init__(self, capacity_bytes: int, offset_mix: float = 0.5, seed: int = 0,
                 spill_dir: str | Path | None = None, *, tail_fraction: float = 0.5,
                 max_sample_tokens: int | None = None, window_context: int = 0,
                 holdout_every: int = 0, holdout_tokens: int | None = None) -> None:
        if capacity_bytes < 1:
            raise FastdraftError(f"DataBuffer capacity_bytes must be >= 1, got {capacity_bytes}")
        if not 0.0 <= offset_mix <= 1.0:
            raise FastdraftError(f"DataBuffer offset_mix must be in [0, 1], got {offset_mix}")
        if not 0.0 < tail_fraction <= 1.0:
            raise FastdraftError(f"DataBuffer tail_fraction must be in (0, 1], got {tail_fraction}")
        if max_sample_tokens is not None and max_sample_tokens < 2:
            raise FastdraftError("DataBuffer max_sample_tokens must be >= 2 (one pair) or None, "
                                 f"got {max_sample_tokens}")
        self.capacity_bytes = capacity_bytes
        if window_context < 0:
            raise FastdraftError(f"DataBuffer window_context must be >= 0, got {window_context}")
        if holdout_every < 0 or holdout_every == 1:
            raise FastdraftError(f"DataBuffer holdout_every must be 0 (none held out) or >= 2 (1 "
                                 f"would hold out every rollout), got {holdout_every}")
        self.holdout_every = holdout_every
        self.holdout_tokens = holdout_tokens or max_sample_tokens
        self.max_sample_tokens, self.window_context = max_sample_tokens, window_context
        self.offset_mix = offset_mix
        self.tail_fraction = tail_fraction
        self._rng = random.Random(seed)
        self._entries: OrderedDict[WindowKey, _Entry] = OrderedDict()  # oldest first
        self._windows: dict[SampleKey, list[WindowKey]] = {}   # a rollout's resident windows
        self._bytes = self._tokens = self._step = 0
        self._evicted = self._cut = 0
        self._spilled = 0  # guarded by _io_lock (stats reads it without)
        self._lock = threading.Lock()
        # Serialises this buffer's disk writes. Taken while `_lock` is still held, so a reward
        # set right after an eviction waits for the eviction's shard to reach the manifest.
        self._io_lock = threading.Lock()
        self._store = None if spill_dir is None else SpillStore(spill_dir)
        records = () if self._store is None else self._store.manifest().records
        self._on_disk: set[WindowKey] = {r.window_key for r in records}
        self._on_disk_requests: set[SampleKey] = {r.key for r in records}

    # -- producer side -------------------------------------------------------------------------

    def add(self, sample: Sample) -> list[SampleKey]:
        """Adds a finished rollout to the current step (as windows when it is longer than
        max_sample_tokens or larger than the capacity), evicting the oldest samples as needed.
        Returns the keys of the samples evicted (a rollout's key once per evicted window).
        Raises a FastdraftError for a key already held, or a capacity below one 2-token window."""
        limit = tokens_within(sample, self.capacity_bytes)
        if limit < 2:
            raise FastdraftError(f"sample {sample.key}: a 2-token window of it takes "
                                 f"{2 * sample.nbytes // sample.num_tokens} bytes, more than the "
                                 f"DataBuffer capacity of {self.capacity_bytes}: raise "
                                 "capacity_bytes")
        if self.is_held_out(sample.key):   # a prefix, never windows: see the class doc
            windows = [sample.truncated(min(limit, self.holdout_tokens or limit,
                                            sample.num_tokens))]
        else:
            size = min(limit, self.max_sample_tokens or limit)
            windows = cut_windows(sample, size, min(self.window_context, size // 2, size - 2))
        with self._lock:
            for window in windows:
                if window.window_key in self._entries:
                    raise FastdraftError(f"sample {window.window_key} (rl_step, request_index, "
                                         "first position) is already in the buffer: each finished "
                                         "request is added once")
            evicted = []
            for window in windows:
                while self._bytes + window.nbytes > self.capacity_bytes:
                    evicted.append(self._pop_oldest())
                self._entries[window.window_key] = _Entry(window, self._step)
                self._windows.setdefault(window.key, []).append(window.window_key)
                self._bytes += window.nbytes
                self._tokens += window.num_tokens
            self._evicted += len(evicted)
            self._cut += not (len(windows) == 1 and windows[0] is sample)
            claim = self._claim_for_disk(evicted)
        self._write(claim)
        return [e.sample.key for e in evicted]

    def set_reward(self, key: SampleKey, reward: float | None) -> bool:
        """Records the reward of the sample `key` = (rl_step, request_index), in memory and on
        disk. False when the sample is neither (evicted without a spill directory)."""
        if reward is not None and not math.isfinite(float(reward)):
            raise FastdraftError(f"reward must be finite or None, got {reward}")
        reward = None if reward is None else float(reward)
        with self._lock:
            resident = self._windows.get(key, [])
            for window_key in resident:   # every window of the rollout
                entry = self._entries[window_key]
                entry.sample = entry.sample.with_reward(reward)
            on_disk = key in self._on_disk_requests
        if on_disk:
            assert self._store is not None
            with self._io_lock:
                on_disk = self._store.set_reward(key, reward)
        return bool(resident) or on_disk

    def advance_step(self) -> None:
        """Ends an RL step: this step's samples become the previous step's; older ones are no
        longer sampled (their policy is two updates old) but stay until evicted."""
        with self._lock:
            self._step += 1

    def flush(self) -> int:
        """Spills every resident sample not yet on disk, and the current step, so that
        `restore` after a restart finds this buffer's state. Returns the samples written."""
        if self._store is None:
            raise FastdraftError("flush needs a spill directory: construct the DataBuffer with "
                                 "spill_dir")
        with self._lock:
            claim = self._claim_for_disk(list(self._entries.values()), always=True)
        self._write(claim)
        return len(claim.items)

    # -- consumer side -------------------------------------------------------------------------

    def sample(self, token_budget: int, pad_to_budget: bool = False, rows: bool = False
               ) -> PackedBatch | None:
        """One packed batch of at most token_budget tokens by one-step-offset sampling (see
        offset_sampler.select_offset); None when neither this step nor the previous one has
        samples. Samples stay in the buffer: a later batch may draw them again. rows: packed
        into rows as long as the longest sample (`pack_rows`) instead of one row."""
        if token_budget < 1:
            raise FastdraftError(f"token_budget must be >= 1, got {token_budget}")
        with self._lock:
            trainable = [e for e in self._entries.values() if not self.is_held_out(e.sample.key)]
            current = [e.sample for e in trainable if e.step == self._step]
            previous = [e.sample for e in trainable if e.step == self._step - 1]
            chosen = select_offset(current, previous, token_budget, self.offset_mix,
                                   self.tail_fraction, self._rng)
        if not chosen:
            return None
        return pack_rows(chosen) if rows else pack(chosen, token_budget, pad_to_budget)

    def is_held_out(self, key: SampleKey) -> bool:
        """Whether rollout `key` = (rl_step, request_index) is held out of training. The
        choice rotates with the step, so one GRPO group does not lose the same member twice."""
        return bool(self.holdout_every) and sum(key) % self.holdout_every == 0

    def held_out(self, token_budget: int) -> list[PackedBatch]:
        """The held-out samples of the current step (of the previous one while the current
        has none), packed in rows (`pack_rows`) into batches of about token_budget tokens
        (one sample longer than that alone); [] when there are none."""
        with self._lock:
            held = [e for e in self._entries.values()
                    if e.step >= self._step - 1 and self.is_held_out(e.sample.key)]
            newest = max((e.step for e in held), default=None)
            chosen = [e.sample for e in held if e.step == newest]
        batches, part, used = [], [], 0
        for sample in chosen:
            if part and used + sample.num_tokens > token_budget:
                batches.append(pack_rows(part))
                part, used = [], 0
            part.append(sample)
            used += sample.num_tokens
        return batches + ([pack_rows(part)] if part else [])

    def stats(self) -> BufferStats:
        with self._lock:
            steps = [e.step for e in self._entries.values()]
            return BufferStats(
                num_samples=len(self._entries), num_bytes=self._bytes, num_tokens=self._tokens,
                capacity_bytes=self.capacity_bytes, step=self._step,
                current_samples=steps.count(self._step),
                previous_samples=steps.count(self._step - 1),
                evicted_samples=self._evicted, spilled_samples=self._spilled,
                cut_samples=self._cut)

    @property
    def step(self) -> int:
        return self._step

    def rng_state(self) -> tuple:
        """The sampling RNG's state (for an exact resume of the trainer)."""
        with self._lock:
            return self._rng.getstate()

    def set_rng_state(self, state: tuple | list) -> None:
        version, internal, gauss = state   # a checkpoint may hand the tuple back as lists
        with self._lock:
            self._rng.setstate((version, tuple(internal), gauss))

    def samples(self) -> list[Sample]:
        """The resident samples, oldest first (a snapshot)."""
        with self._lock:
            return [e.sample for e in self._entries.values()]

    # -- restart -------------------------------------------------------------------------------

    @classmethod
    def restore(cls, spill_dir: str | Path, capacity_bytes: int, offset_mix: float = 0.5,
                seed: int = 0, *, tail_fraction: float = 0.5) -> DataBuffer:
        """A buffer over `spill_dir` holding the newest spilled samples that fit in
        capacity_bytes, at the step the directory recorded (each sample keeps the step it was
        added in, so one-step-offset sampling resumes where it stopped)."""
        buf = cls(capacity_bytes, offset_mix, seed, spill_dir, tail_fraction=tail_fraction)
        assert buf._store is not None
        manifest = buf._store.manifest()
        records = sorted(manifest.latest(), key=lambda r: r.added_step)  # stable: write order
        kept, used = [], 0
        for r in reversed(records):  # newest first, until the next one does not fit
            if used + r.nbytes > capacity_bytes:
                break
            kept.append(r)
            used += r.nbytes
        kept.reverse()
        for r, sample in zip(kept, load_records(spill_dir, kept)):
            buf._entries[sample.window_key] = _Entry(sample, r.added_step)
            buf._windows.setdefault(sample.key, []).append(sample.window_key)
            buf._bytes += sample.nbytes
            buf._tokens += sample.num_tokens
        buf._step = manifest.step
        return buf

    # -- internals (called with _lock held where noted) ----------------------------------------

    def _pop_oldest(self) -> _Entry:
        """With _lock held."""
        window_key, entry = self._entries.popitem(last=False)
        windows = self._windows[entry.sample.key]
        windows.remove(window_key)
        if not windows:
            del self._windows[entry.sample.key]
        self._bytes -= entry.sample.nbytes
        self._tokens -= entry.sample.num_tokens
        return entry

    def _claim_for_disk(self, entries: list[_Entry], always: bool = False) -> _Claim:
        """With _lock held: the entries not on disk yet, marked as on disk. Takes _io_lock
        (released by _write) when there is something to write, or always (flush: the step)."""
        if self._store is None:
            return _Claim([], self._step, locked=False)
        items = [(e.sample, e.step) for e in entries
                 if e.sample.window_key not in self._on_disk]
        if not items and not always:
            return _Claim([], self._step, locked=False)
        self._on_disk.update(s.window_key for s, _ in items)
        self._on_disk_requests.update(s.key for s, _ in items)
        self._io_lock.acquire()
        return _Claim(items, self._step, locked=True)

    def _write(self, claim: _Claim) -> None:
        """Without _lock: writes what _claim_for_disk claimed and releases _io_lock. Never takes
        _lock while holding _io_lock: a thread holding _lock may be waiting for _io_lock."""
        if not claim.locked:
            return
        assert self._store is not None
        try:
            self._store.write(claim.items, claim.step)
            self._spilled += len(claim.items)  # guarded by _io_lock
        except BaseException:
            self._io_lock.release()
            with self._lock:  # not on disk after all: a later flush retries them
                self._on_disk.difference_update(s.window_key for s, _ in claim.items)
            raise
        self._io_lock.release()
