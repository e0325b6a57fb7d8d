"""SampleCollector: turns the engine's hidden-state records (engine/capture.py) into DataBuffer
samples, one per finished request, the moment it finishes (while the tail still decodes).

A request of L tokens (prompt + answer) has hidden states at positions 0 .. L - 2 (its last
token, often EOS, is never fed back to the policy), so its Sample holds the first L - 1 tokens
and their hidden states: every (hidden t, token t + 1) pair the drafter trains on, the one
predicting the last token included. loss_mask marks the pairs whose prediction is an answer
token (what the drafter drafts), as the offline warm-up does.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch

from fastdraft.databuffer import DataBuffer, Sample
from fastdraft.drafter.warmup import first_drafted_pair
from fastdraft.engine import Completion
from fastdraft.engine.capture import HiddenRecord


class SampleCollector:
    def __init__(self, buffer: DataBuffer) -> None:
        self.buffer = buffer
        self.rl_step = 0
        self._records: dict[int, list[HiddenRecord]] = defaultdict(list)
        self._lock = threading.Lock()
        self.num_added = 0

    def start_step(self, rl_step: int) -> None:
        """A new rollout: request indices restart at 0."""
        with self._lock:
            self.rl_step = rl_step
            self._records.clear()

    def on_hidden(self, record: HiddenRecord) -> None:
        with self._lock:
            self._records[record.request_index].append(record)

    def on_finish(self, completion: Completion) -> None:
        with self._lock:
            records = self._records.pop(completion.index, [])
        if not records:
            return
        sequence = completion.prompt_token_ids + completion.token_ids
        positions = torch.cat([r.positions for r in records])
        if positions.tolist() != list(range(len(sequence) - 1)):
            raise RuntimeError(f"request {completion.index}: hidden-state records cover "
                               f"positions {positions[:3].tolist()}.. of a {len(sequence)}-token "
                               "sequence: the engine's capture lost a step")
        num = len(sequence) - 1
        if num < 2:
            return  # no (hidden t, token t + 1) pair to train on
        loss_mask = torch.zeros(num, dtype=torch.bool)
        loss_mask[first_drafted_pair(len(completion.prompt_token_ids)):] = True
        aux_count = len(records[0].aux)
        self.buffer.add(Sample(
            request_index=completion.index, policy_version=records[0].policy_version,
            rl_step=self.rl_step, token_ids=torch.tensor(sequence[:num]), positions=positions,
            hidden=torch.cat([r.final for r in records]), loss_mask=loss_mask,
            aux_hidden=tuple(torch.cat([r.aux[i] for r in records]) for i in range(aux_count))))
        self.num_added += 1

    def set_rewards(self, rewards: list[float]) -> None:
        """The rollout's rewards, in request order."""
        for index, reward in enumerate(rewards):
            self.buffer.set_reward((self.rl_step, index), reward)
