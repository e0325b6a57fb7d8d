"""RolloutWorker: one rollout engine replica in a process of its own (a Ray actor; one device
each on a GPU node). It generates the requests the driver's RolloutPool hands it and takes
the policy's and drafter's weights from the object store between steps. It knows no RL: what
it returns is a WorkerRollout, the engine's completions and records as they are.

Tail consolidation (cluster.consolidate_below): a worker whose unfinished requests fall below
the threshold while a peer still generates hands them back (WorkerRollout.migrated) and goes
idle; the driver puts them into a generating peer's running call (`accept`, served on a thread
of its own beside `generate`), which finishes them exactly as the donor would have
(engine/migration.py). Requests keep their index in the whole rollout wherever they run; on an
engine they are numbered -1 - index so they never collide with the call's own prompts."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
import torch

from fastdraft.config.engine import SpecConfig
from fastdraft.databuffer import Sample
from fastdraft.engine import Completion, RolloutEngine, SamplingParams
from fastdraft.engine.capture import HiddenRecord
from fastdraft.engine.migration import Inbox, MigratedRequest
from fastdraft.engine.spec.stats import SpecStats
from fastdraft.engine.trace import RolloutTrace
from fastdraft.models.tensor_parallel import TPRank

# (device, tp=None) -> a new engine with the run's settings (tp: its tensor-parallel rank)
EngineFactory = Callable[..., RolloutEngine]


@dataclass(frozen=True)
class Capture:
    """What the driver's SampleCollector asks of a worker's hidden states: samples of the RL
    step `rl_step`, at most `budget_bytes` of running requests' rows held (the worker's host
    memory), `row_bytes` a captured token."""

    rl_step: int
    budget_bytes: int | None
    row_bytes: int


@dataclass
class WorkerRollout:
    """What one worker's share of a rollout produced: completions under their indices in the
    whole rollout, and what its capture did (the samples themselves are generate's second
    return: the driver passes that reference on to the trainer unopened). start / end:
    wall-clock seconds (time.time(), comparable across a node's processes)."""

    completions: list[Completion]
    dropped_tokens: int = 0        # captured rows refused by the byte budget
    peak_bytes: int = 0
    trace: RolloutTrace = field(default_factory=RolloutTrace)
    stats: SpecStats = field(default_factory=SpecStats)
    start: float = 0.0
    end: float = 0.0
    migrated: list[MigratedRequest] = field(default_factory=list)   # yielded, unfinished
    sample_requests: int = 0       # requests the samples (the call's second return) are of


HANDOFF = "handoff"   # the concurrency group of accept / peers: beside a running generate


class RolloutWorker:
    def __init__(self, make_engine: EngineFactory, device: str, threads: int,
                 tp: TPRank | None = None) -> None:
        if threads:   # a worker of N threads uses N cores: Ray placed it for that many
            torch.set_num_threads(threads)
        self.engine = make_engine(device) if tp is None else make_engine(device, tp=tp)
        self._lock = threading.Lock()
        self._calls: dict[int, _Call] = {}   # ticket -> a generate running or still queued
        self._ended = 0   # the last ticket whose generate ended (they run in ticket order)

    def pid(self) -> int:
        return os.getpid()

    @ray.method(num_returns=2)
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 stream_ids: list[int], capture: Capture | None, *,
                 resume: list[MigratedRequest] = (), ticket: int = 1, peers_busy: int = 0,
                 yield_below: int = 0) -> tuple[WorkerRollout, list[Sample]]:
        """The engine's generate on this share, request i as request stream_ids[i] of the whole
        rollout: its random stream (so the share it lands in changes nothing) and its index.
        With capture, each finished request becomes drafter samples here, while this worker's
        tail still decodes: one sample a request, not a record a step, returned as a second
        object the driver hands to the trainer without opening it. resume: requests another
        worker yielded (global indices). yield_below > 0: hand the tail back once fewer
        requests are left, if a peer still generates. ticket: the pool's number of this call
        (accept / peers name it; it may be queued still)."""
        from fastdraft.trainer.collector import SampleCollector
        start = time.time()
        samples = _SampleList()
        collector = None if capture is None else SampleCollector(
            samples, capture.budget_bytes, capture.row_bytes)
        if collector is not None:
            collector.start_step(capture.rl_step)
        mine = self._call(ticket)
        if mine.peers_busy is None:   # no newer word from the pool while it was queued
            mine.peers_busy = peers_busy
        index = _Index(stream_ids)
        try:
            completions = self.engine.generate(
                prompts, params, use_tqdm=False, stream_ids=stream_ids,
                on_hidden=None if collector is None else _InRollout(collector, index),
                on_finish=None if collector is None else (
                    lambda c: collector.on_finish(_global(c, index))),
                resume=[_local(m) for m in resume], inbox=mine.inbox,
                yield_below=yield_below, should_yield=lambda: mine.peers_busy > 0)
        finally:
            mine.inbox.close()   # (the engine closed it already, unless it raised)
            with self._lock:
                self._ended = max(self._ended, ticket)
                self._calls.pop(ticket, None)
        migrated = [dataclasses.replace(m, index=index(m.index))
                    for m in self.engine.last_migrated]
        if collector is not None:   # the receiver re-captures them whole from its prefill
            collector.discard([m.index for m in migrated])
        return WorkerRollout([_global(c, index) for c in completions],
                             0 if collector is None else collector.dropped_tokens,
                             0 if collector is None else collector.peak_bytes,
                             self.engine.last_trace, self.engine.last_stats, start, time.time(),
                             migrated, len({s.request_index for s in samples})), list(samples)

    @ray.method(concurrency_group=HANDOFF)
    def accept(self, migrated: list[MigratedRequest], ticket: int) -> bool:
        """Another worker's tail into generate call `ticket`, running or still queued (it
        takes them at its first step); False (nothing taken) once that call has ended: the
        pool then sends them elsewhere."""
        mine = self._call(ticket)
        return mine is not None and mine.inbox.put([_local(m) for m in migrated])

    @ray.method(concurrency_group=HANDOFF)
    def peers(self, ticket: int, busy: int) -> None:
        """How many peers still generate, as the pool sees it after a worker's share ended."""
        mine = self._call(ticket)
        if mine is not None:
            mine.peers_busy = busy

    def _call(self, ticket: int) -> _Call | None:
        """Call `ticket`'s state, made by whichever of generate / accept / peers comes first;
        None once it has ended."""
        with self._lock:
            if ticket <= self._ended:
                return None
            return self._calls.setdefault(ticket, _Call())

    def load_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> int:
        return self.engine.load_weights(named, version)

    def load_drafter_weights(self, named: list[tuple[str, torch.Tensor]], version: int,
                             checksum: str | None) -> int:
        return self.engine.load_drafter_weights(named, version, checksum=checksum)

    def gpu(self) -> tuple[str, str]:
        """(the GPU Ray gave this worker, as the node numbers it; its node id)."""
        context = ray.get_runtime_context()
        return str(context.get_accelerator_ids()["GPU"][0]), context.get_node_id()

    def sleep(self) -> int:
        """The engine's device memory back until its next call (engine/updates.py sleep);
        the bytes given back."""
        return self.engine.sleep()

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


@dataclass
class _Call:
    """One generate call as accept / peers see it: where tails go in, and how many peers the
    pool last saw generating (it yields only while one does; None: not yet told)."""

    inbox: Inbox = field(default_factory=Inbox)
    peers_busy: int | None = None


class _SampleList(list):
    """A SampleCollector's buffer that keeps the samples for the driver."""

    def add(self, sample: Sample) -> None:
        self.append(sample)


class _Index:
    """An engine index -> the request's index in the whole rollout: this share's prompts are
    0..n-1 (stream_ids[i]), requests from other workers -1 - index."""

    def __init__(self, stream_ids: list[int]) -> None:
        self.stream_ids = stream_ids

    def __call__(self, i: int) -> int:
        return self.stream_ids[i] if i >= 0 else -1 - i


def _local(migrated: MigratedRequest) -> MigratedRequest:
    return dataclasses.replace(migrated, index=-1 - migrated.index)


class _InRollout:
    """The collector as the engine's sink, seeing each row under its index in the whole
    rollout."""

    def __init__(self, collector, index: _Index) -> None:
        self.collector, self.index = collector, index

    def wants(self, request_indices: list[int], num_tokens: list[int]) -> list[bool]:
        return self.collector.wants([self.index(i) for i in request_indices], num_tokens)

    def __call__(self, record: HiddenRecord) -> None:
        self.collector(dataclasses.replace(record, request_index=self.index(record.request_index)))


def _global(completion: Completion, index: _Index) -> Completion:
    return dataclasses.replace(completion, index=index(completion.index))
