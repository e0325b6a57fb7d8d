"""RolloutWorker: one rollout engine replica in a process of its own (a Ray actor; one device
each on a GPU node). It generates the requests the driver's RolloutPool hands it and takes
the policy's and drafter's weights from the object store between steps. It knows no RL: what
it returns is a WorkerRollout, the engine's completions and records as they are."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fastdraft.engine import Completion, RolloutEngine, SamplingParams
from fastdraft.engine.capture import HiddenRecord
from fastdraft.engine.spec.config import SpecConfig
from fastdraft.engine.spec.stats import SpecStats
from fastdraft.engine.trace import RolloutTrace

EngineFactory = Callable[[str], RolloutEngine]   # device -> a new engine (the run's settings)


@dataclass
class WorkerRollout:
    """What one worker's share of a rollout produced, in the order it was handed out.
    start / end: wall-clock seconds (time.time(), comparable across the node's processes)."""

    completions: list[Completion]
    records: list[HiddenRecord] = field(default_factory=list)   # only when capture was asked
    trace: RolloutTrace = field(default_factory=RolloutTrace)
    stats: SpecStats = field(default_factory=SpecStats)
    start: float = 0.0
    end: float = 0.0


class RolloutWorker:
    def __init__(self, make_engine: EngineFactory, device: str, threads: int) -> None:
        if threads:   # a worker of N threads uses N cores: Ray placed it for that many
            torch.set_num_threads(threads)
        self.engine = make_engine(device)

    def pid(self) -> int:
        return os.getpid()

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 stream_ids: list[int], capture: bool) -> WorkerRollout:
        """The engine's generate on this share; stream_ids keep every request on the random
        stream it has in the whole rollout, so the share it lands in changes nothing."""
        start = time.time()
        records: list[HiddenRecord] = []
        completions = self.engine.generate(prompts, params, use_tqdm=False,
                                           on_hidden=records.append if capture else None,
                                           stream_ids=stream_ids)
        return WorkerRollout(completions, records, self.engine.last_trace,
                             self.engine.last_stats, start, time.time())

    def load_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> int:
        return self.engine.load_weights(named, version)

    def load_drafter_weights(self, named: list[tuple[str, torch.Tensor]], version: int,
                             checksum: str | None) -> int:
        return self.engine.load_drafter_weights(named, version, checksum=checksum)

    def set_spec(self, spec: SpecConfig, fallback_reason: str | None) -> None:
        """Speculation as the driver's engine has it (a health fallback, or back on)."""
        if fallback_reason is not None:
            self.engine.fall_back_to_plain(fallback_reason)
        elif not self.engine.spec.enabled and spec.enabled:
            self.engine.resume_speculation(spec)

    def advance_step(self) -> None:
        self.engine.advance_step()

    def state_dict(self) -> dict:
        return self.engine.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dict(state)
