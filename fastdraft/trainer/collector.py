"""SampleCollector: turns the engine's hidden-state records (engine/capture.py) into DataBuffer
samples, one per finished request, the moment it finishes (while the tail still decodes).

A request of L tokens (prompt + answer) has hidden states at positions 0 .. L - 2 (its last
token, often EOS, is never fed back to the policy), so its Sample holds the first L - 1 tokens
and their hidden states: every (hidden t, token t + 1) pair the drafter trains on, the one
predicting the last token included. loss_mask marks the pairs whose prediction is an answer
token (what the drafter drafts), as the offline warm-up does.

Memory: the records of running requests wait here until their request finishes. At real size
that is the whole rollout's hidden states (1024 requests x 1000 tokens x 32 KiB = 32 GB for an
8B EAGLE-3 policy), so at most `budget_bytes` are held: the collector is the engine's sink with
a `wants` filter (capture.row_filter), and rows that do not fit are refused before the engine
copies them to the host, counted in `dropped_tokens`.

What is kept under the budget is whole requests, not the rows that happen to fit. A request is
admitted at its first row (its prefill) while at most ADMIT_SHARE of the budget is held, the
rest being room for the admitted ones to grow; a request not admitted is not captured at all.
An admitted request that outgrows the room left is cut there: its rows so far stay one sample,
nothing after is kept. Keeping whatever rows fit instead filled the budget with every
request's prompt and first answer tokens and dropped the rest: on the miniature the drafter
then trained on early answer positions only, and 12 micro-steps on such data lowered its
accept length (6.12 -> 6.08, answers cut 40 tokens in) where the same steps on whole rollouts
raised it (-> 6.22-6.24, even on 20-128 of them).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import torch

from fastdraft.databuffer import DataBuffer, Sample
from fastdraft.drafter.warmup import first_drafted_pair
from fastdraft.engine import Completion
from fastdraft.engine.capture import HiddenRecord
from fastdraft.errors import FastdraftError
from fastdraft.utils.objects import resolved

#: Share of the budget below which a new request is admitted (the rest: room to grow).
ADMIT_SHARE = 0.5


class SampleCollector:
    """buffer: where samples go (a DataBuffer, or a trainer handle's producer side).
    budget_bytes: hidden-state bytes of running requests held at most (None: no bound).
    row_bytes: bytes of one captured token (its final and aux hidden rows, position and id),
    for `wants` to decide before anything is copied; learnt from the first record if 0."""

    def __init__(self, buffer: DataBuffer, budget_bytes: int | None = None,
                 row_bytes: int = 0) -> None:
        if budget_bytes is not None and budget_bytes < 1:
            raise FastdraftError(f"SampleCollector budget_bytes must be >= 1, got {budget_bytes}")
        self.buffer = buffer
        self.budget_bytes, self.row_bytes = budget_bytes, row_bytes
        self.rl_step = 0
        self._records: dict[int, list[HiddenRecord]] = defaultdict(list)
        self._dropped: dict[int, int] = defaultdict(int)   # rows refused, per request
        self._admitted: set[int] = set()   # requests captured (until cut)
        self._closed: set[int] = set()     # requests refused or cut: no more rows kept
        self._lock = threading.Lock()
        self.held_bytes = self.peak_bytes = 0
        self.num_added = 0
        self.dropped_tokens = 0   # since construction

    def start_step(self, rl_step: int) -> None:
        """A new rollout: request indices restart at 0."""
        with self._lock:
            self.rl_step = rl_step
            self._records.clear()
            self._dropped.clear()
            self._admitted.clear()
            self._closed.clear()
            self.held_bytes = 0

    # ------------------------------------------------------------------- the engine's sink
    def wants(self, request_indices: list[int], num_tokens: list[int]) -> list[bool]:
        """Which of a step's rows are kept (in row order; the rest are counted as dropped and
        never copied). Rows admitted here are handed to __call__ at once."""
        with self._lock:
            if self.budget_bytes is None:
                return [True] * len(request_indices)
            held, out = self.held_bytes, []
            for index, n in zip(request_indices, num_tokens):
                keep = self._keeps(index, n * self.row_bytes, held)
                out.append(keep)
                if keep:
                    held += n * self.row_bytes
                else:
                    self._drop(index, n)
            return out

    def _keeps(self, index: int, need: int, held: int) -> bool:
        """With _lock held: whether a row of `need` bytes of request `index` is kept when
        `held` bytes are; a refused row closes its request."""
        assert self.budget_bytes is not None
        if index in self._closed:
            return False
        if index not in self._admitted:   # its first row: admit the request, or never
            if held + need > ADMIT_SHARE * self.budget_bytes:
                self._closed.add(index)
                return False
            self._admitted.add(index)
        if held + need > self.budget_bytes:   # cut: what it has so far stays one sample
            self._closed.add(index)
            return False
        return True

    def __call__(self, record: HiddenRecord) -> None:
        n = record.positions.shape[0]
        with self._lock:
            if not self.row_bytes and n:
                self.row_bytes = record.nbytes // n
            # The budget holds even for an engine that does not ask `wants` first.
            if self.budget_bytes is not None and not self._keeps(
                    record.request_index, record.nbytes, self.held_bytes):
                self._drop(record.request_index, n)
                return
            self._records[record.request_index].append(record)
            self.held_bytes += record.nbytes
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    on_hidden = __call__   # the name the bench and older callers use

    def _drop(self, index: int, n: int) -> None:
        """With _lock held."""
        self._dropped[index] += n
        self.dropped_tokens += n

    def discard(self, request_indices: list[int]) -> None:
        """Forgets requests that will not finish here (migrated to another engine, which
        captures them whole again)."""
        with self._lock:
            for index in request_indices:
                self.held_bytes -= sum(r.nbytes for r in self._records.pop(index, []))
                self._admitted.discard(index)
                self._closed.discard(index)
                self.dropped_tokens -= self._dropped.pop(index, 0)   # counted where it ends

    # ------------------------------------------------------------------------- finished
    def on_finish(self, completion: Completion) -> None:
        with self._lock:
            records = self._records.pop(completion.index, [])
            dropped = self._dropped.pop(completion.index, 0)
            self.held_bytes -= sum(r.nbytes for r in records)
        if not records:
            return
        sequence = completion.prompt_token_ids + completion.token_ids
        num = len(sequence) - 1
        positions = torch.cat([r.positions for r in records])
        kept = len(positions)   # a prefix: a request is captured from its first row until cut
        if kept + dropped != num or not torch.equal(positions, torch.arange(kept)):
            raise RuntimeError(f"request {completion.index}: hidden-state records cover "
                               f"positions {positions[:3].tolist()}.. ({kept} kept, "
                               f"{dropped} dropped) of a {len(sequence)}-token sequence: the "
                               "engine's capture lost a step")
        loss_mask = positions >= first_drafted_pair(len(completion.prompt_token_ids))
        if kept < 2 or not loss_mask.any():
            with self._lock:   # no (hidden t, token t + 1) pair, or prompt only: nothing drafted
                self.dropped_tokens += kept
            return
        self.buffer.add(Sample(
            request_index=completion.index, policy_version=records[0].policy_version,
            rl_step=self.rl_step, token_ids=torch.tensor(sequence[:kept]), positions=positions,
            hidden=torch.cat([r.final for r in records]), loss_mask=loss_mask,
            aux_hidden=tuple(torch.cat([r.aux[i] for r in records])
                             for i in range(len(records[0].aux)))))
        self.num_added += 1

    def add_remote(self, samples: list[Sample] | Any, requests: int, dropped_tokens: int,
                   peak_bytes: int) -> None:
        """Samples (of `requests` requests) another process's collector made of its share of
        the rollout (a Ray rollout worker's), or a Ray reference to them, with what its budget
        refused and held at most. A buffer that takes a batch (the online drafter) gets the
        reference as it is: the samples go from the worker to the trainer, not through here."""
        add_many = getattr(self.buffer, "add_many", None)
        if add_many is not None:
            add_many(samples)
        else:
            for sample in resolved(samples):
                self.buffer.add(sample)
        with self._lock:
            self.num_added += requests
            self.dropped_tokens += dropped_tokens
            self.peak_bytes = max(self.peak_bytes, peak_bytes)

    def set_rewards(self, rewards: list[float]) -> None:
        """The rollout's rewards, in request order."""
        for index, reward in enumerate(rewards):
            self.buffer.set_reward((self.rl_step, index), reward)

