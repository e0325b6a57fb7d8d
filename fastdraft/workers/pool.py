"""RolloutPool: the rollout engine of a Ray run, as the RL loop sees it. It has the engine's
interface (generate, weights and drafter between steps, fallback, state) and serves it with
`cluster.rollout_workers` RolloutWorker replicas in a Ray placement group:

- generate: whole GRPO groups dispatched (cluster/dispatch.py) by their predicted cost (the
  answer lengths their prompt had last time); every request keeps its random stream (its index
  in the whole rollout), so placement never changes a completion. A worker's completions and
  hidden states reach the callbacks when its share is done, while the others still decode.
- weights: the actor's tensors go once into the object store and every worker loads them from
  there (`timing/push_s`), the drafter too (checksummed, versioned); hybrid workers load both
  on their devices (the weights from the actor's shards, the drafter broadcast from the
  worker whose trainer member published it).
- faults: a worker that dies mid-rollout has its unfinished share re-run on the live workers
  (the same streams: the same completions) and is replaced with the current weights.

The driver keeps a host replica (`host`: the policy, or its head for hybrid workers, and the
drafter on the CPU): what a replacement worker starts from and what the online drafter reads.
Ray must be up (run/placement.connect_ray)."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from fastdraft.actor.rank import ActorSpec
from fastdraft.cluster.dispatch import assign_groups
from fastdraft.cluster.node_checks import check_nodes
from fastdraft.cluster.reserve import (
    ACTOR_GPU_SHARE,
    TRAINER_GPU_SHARE,
    in_bundle,
    reserve,
    worker_bundle,
)
from fastdraft.config.engine import SpecConfig
from fastdraft.config.sections.cluster import ClusterConfig
from fastdraft.engine import Completion, RolloutEngine, SamplingParams
from fastdraft.engine.host_front import HostFront
from fastdraft.engine.request import prompt_key
from fastdraft.engine.spec.stats import SpecStats
from fastdraft.engine.trace import RolloutTrace
from fastdraft.errors import FastdraftError
from fastdraft.models import ModelConfig
from fastdraft.observability.timeline import Span
from fastdraft.trainer.collector import SampleCollector
from fastdraft.utils.weight_buckets import weight_buckets
from fastdraft.workers.hybrid import HybridWorker, WeightSync, rendezvous
from fastdraft.workers.hybrid_ranks import WorkerRanks, get_all, share_drafter
from fastdraft.workers.ranks import ActorRankError
from fastdraft.workers.rollout_account import account
from fastdraft.workers.rollout_calls import RolloutCalls
from fastdraft.workers.rollout_worker import (
    HANDOFF,
    Capture,
    EngineFactory,
    RolloutWorker,
    WorkerRollout,
)
from fastdraft.workers.trainer_actor import TRAINER, InWorker, OwnActor, Placement

OnFinish = Callable[[Completion], None]


class RolloutPool(HostFront):
    """Rollout engine replicas on Ray workers behind the engine's interface; what the loop
    reads of an engine's state is the host replica's (engine/host_front.py)."""

    def __init__(self, cfg: ClusterConfig, make_engine: EngineFactory, host: RolloutEngine,
                 device: str, group_size: int, actor: ActorSpec | None = None,
                 paths: dict[str, Path | None] | None = None, tensor_parallel: int = 1) -> None:
        """actor (cluster.placement=hybrid): every worker is a HybridWorker holding actor rank
        r beside its engine (workers/hybrid.py); the ranks rendezvous on worker 0's node.
        paths (setting -> path): what the workers load, checked on every worker's node before
        any worker starts (cluster/node_checks.py). tensor_parallel k (hybrid): each k
        consecutive workers serve one replica (the same calls on each; the first answers)."""
        self.cfg, self.make_engine, self.host = cfg, make_engine, host
        self.group_size, self.tensor_parallel = group_size, tensor_parallel
        self.device = cfg.worker_device or ("cuda" if device.startswith("cuda") else device)
        self.bundle = worker_bundle(cfg, self.device)
        self.group = reserve([self.bundle] * cfg.rollout_workers, cfg.placement_timeout_s,
                             f"cluster.rollout_workers={cfg.rollout_workers}")
        check_nodes(self.group, cfg.rollout_workers, paths or {}, cfg.placement_timeout_s)
        self.actor = None if actor is None else self._rendezvous(actor)
        self.workers = [self._start(i) for i in range(cfg.rollout_workers)]
        self.restarts = 0
        self.closed = False
        self._weights: list[Any] | None = None   # object refs of the newest weights' buckets
        self._drafter: tuple[Any, int, str | None] | None = None   # (ref, version, checksum)
        self._lengths: dict[int, float] = {}   # prompt key -> its answers' mean length
        self.last_trace, self.last_stats = RolloutTrace(), SpecStats()
        self.last_spans: list[Span] = []
        self.last_parts: list[WorkerRollout] = []   # what each worker call of the last rollout did
        self.last_migrated = 0   # requests that changed worker in the last rollout
        self.last_push_s = 0.0
        self.last_syncs: list[WeightSync] = []   # hybrid: each worker's last weight sync
        self.last_released_bytes = 0   # what the workers gave back for the actor's update
        self.reruns = 0   # requests re-run after their worker died (this run)
        self.tickets = itertools.count(1)   # numbers every worker call: accept / peers name one
        self.calls: RolloutCalls | None = None   # the latest rollout's worker calls
        # Called when a worker's share is done while others still generate; True when that
        # promoted the worker to drafter training (the online drafter's on_worker_idle).
        self.idle_hook: Callable[[int], bool] | None = None

    @property
    def colocated(self) -> bool:
        return self.cfg.placement == "colocated"

    @property
    def hybrid(self) -> bool:
        return self.actor is not None

    def _start(self, index: int) -> Any:
        share = (1.0 if self.actor is not None   # hybrid: the trainer member is inside it
                 else 1 - TRAINER_GPU_SHARE - (ACTOR_GPU_SHARE if self.colocated else 0.0))
        cls = self._remote_class().options(
            num_cpus=self.bundle["CPU"], **self._in_bundle(index, share),
            name=None, max_restarts=0)
        if self.actor is None:
            return cls.remote(self.make_engine, self.device, self.cfg.worker_threads)
        return cls.remote(self.make_engine, self.device, self.cfg.worker_threads, self.actor,
                          index, tensor_parallel=self.tensor_parallel)

    def _rendezvous(self, actor: ActorSpec) -> ActorSpec:
        """The actor spec with rank 0's address: worker 0's node as Ray names it, a port free
        there (asked by a task in worker 0's bundle), never this machine's loopback unless
        that is where worker 0 runs."""
        import ray
        where = ray.remote(rendezvous).options(num_cpus=0, **self._in_bundle(0, 0.0))
        address, port = ray.get(where.remote(), timeout=self.cfg.placement_timeout_s)
        return dataclasses.replace(actor, address=address, port=port)

    def ranks(self, config: ModelConfig) -> WorkerRanks:
        """The actor's ranks in these workers (hybrid placement), for actor/actor.Actor."""
        if self.actor is None:
            raise RuntimeError("the pool's workers hold actor ranks only with hybrid placement")
        return WorkerRanks(self.workers, config)

    def actor_rank_options(self, rank: int) -> dict[str, Any]:
        """Where colocated actor rank `rank` (1..N-1) goes: rollout worker `rank`'s bundle and
        device, no cores of its own (it computes while the worker sleeps)."""
        if not self.colocated:
            raise FastdraftError("actor ranks share the rollout workers' bundles only with "
                                 "cluster.placement=colocated")
        return {"num_cpus": 0, **self._in_bundle(rank, ACTOR_GPU_SHARE)}

    def trainer_placement(self, index: int | None = None) -> Placement:
        """Where the online drafter's trainer (or data-parallel member `index`) runs: inside
        hybrid worker `index` (its member: the worker's process and device, no process or
        device context of its own), else a Ray actor on that worker's bundle and device, no
        cores of its own. The last worker (the default) is the first to go idle under
        `concentrate` dispatch (it holds the shortest groups): its trainer trains beside the
        tail of the others."""
        index = len(self.workers) - 1 if index is None else index
        if self.actor is not None:
            return InWorker(self.workers[index], index)
        return OwnActor({"num_cpus": 0, **self._in_bundle(index, TRAINER_GPU_SHARE)})

    def _in_bundle(self, index: int, gpu_share: float) -> dict[str, Any]:
        return in_bundle(self.group, self.bundle, index, gpu_share)

    def _remote_class(self) -> Any:
        import ray
        # accept / peers run on a thread of their own, beside the running generate.
        if self.actor is None:
            return ray.remote(concurrency_groups={HANDOFF: 1})(RolloutWorker)
        # a hybrid worker: its trainer member's calls on a thread of their own too
        return ray.remote(concurrency_groups={HANDOFF: 1, TRAINER: 1})(HybridWorker)

    # --------------------------------------------------------------------- the engine's face
    @property
    def worker_names(self) -> list[str]:
        return [f"rollout{i}" for i in range(len(self.workers))]

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams, *,
                 on_finish: OnFinish | None = None, on_hidden: SampleCollector | None = None,
                 use_tqdm: bool | None = None) -> list[Completion]:
        """One completion per prompt, in prompt order; groups of `group_size` consecutive
        prompts stay together. on_hidden: the online drafter's collector; each worker turns its
        requests' hidden states into samples as they finish (its budget) and they join the
        collector's buffer when the worker's share is done. With cluster.consolidate_below a
        worker's tail moves to a worker still generating, and the donor goes idle (or trains)."""
        import ray
        n, size = len(prompt_token_ids), self.group_size
        if n % size:
            raise FastdraftError(f"{n} prompts are not whole groups of {size}")
        groups = [list(range(g, g + size)) for g in range(0, n, size)]
        costs = [self._lengths.get(prompt_key(prompt_token_ids[g[0]]), self._mean_length())
                 for g in groups]
        tp = self.tensor_parallel
        owner = assign_groups(costs, len(self.workers) // tp, self.cfg.dispatch)
        shares = [[i for g, w in zip(groups, owner) if w == r for i in g]
                  for r in range(len(self.workers) // tp)]
        capture = None if on_hidden is None else Capture(
            on_hidden.rl_step, on_hidden.budget_bytes, on_hidden.row_bytes)
        self.calls = call = RolloutCalls(self, prompt_token_ids, params, capture)
        for r, share in enumerate(shares):
            if share:
                call.submit_replica(range(r * tp, (r + 1) * tp), share,
                                    peers_busy=sum(map(bool, shares)) - 1)
        start = time.time()
        results: list[Completion | None] = [None] * n
        done: list[tuple[int, WorkerRollout]] = []
        followers: list[tuple[int, WorkerRollout]] = []
        training: dict[int, float] = {}   # worker -> when it was promoted to drafter training
        while call.pending:
            ready, _ = ray.wait(list(call.pending), num_returns=1)
            ended = call.pending.pop(ready[0])
            k = ended.worker
            try:
                part: WorkerRollout = ray.get(ready[0])
            except ray.exceptions.RayActorError as err:
                call.rerun(k, ended.indices, err)
                continue
            if ended.follower:   # the replica's first rank answers for it
                followers.append((k, part))
                continue
            done.append((k, part))
            if on_hidden is not None:
                on_hidden.add_remote(ended.samples, part.sample_requests,
                                     part.dropped_tokens, part.peak_bytes)
            for completion in part.completions:
                results[completion.index] = completion
                if on_finish is not None:
                    on_finish(completion)
            if part.migrated:
                call.forward(k, part.migrated)
            call.tell_peers()
            if (call.pending and k not in call.busy() and self.idle_hook is not None
                    and self.idle_hook(k)):
                training[k] = time.time()
        self.last_trace, self.last_stats, self.last_spans = account(
            done, training, start, time.time(), n, followers)
        self.last_parts = [part for _, part in done]
        self.last_migrated = call.migrated
        if self.colocated or self.hybrid:   # the actor's update comes next, on their devices
            self.last_released_bytes = sum(filter(None, self._on_all(lambda w: w.sleep.remote())))
        out = [c for c in results if c is not None]
        for g in groups:
            self._lengths[prompt_key(prompt_token_ids[g[0]])] = sum(
                len(out[i].token_ids) for i in g) / len(g)
        return out

    def _mean_length(self) -> float:
        return sum(self._lengths.values()) / len(self._lengths) if self._lengths else 1.0

    # -------------------------------------------------------------------- between steps
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                     version: int | None = None) -> int:
        """The policy's new weights into every worker: the actor's gather is streamed in
        buckets of cluster.push_bucket_mb, each put into the object store once and loaded by
        every worker while the next is gathered, so the driver never holds more than a bucket
        beyond its host replica."""
        import ray
        start = time.perf_counter()
        version = self.host.policy_version + 1 if version is None else version
        refs, loads = [], []
        for bucket in weight_buckets(named_tensors, int(self.cfg.push_bucket_mb * 2**20)):
            self.host.load_weights(bucket, version)
            refs.append(ray.put(bucket))
            loads += [w.load_weights.remote(refs[-1], version) for w in self.workers]
        self._weights = refs
        self._wait(loads)
        self.last_push_s = time.perf_counter() - start
        return version

    def sync_weights(self, version: int | None = None, advance_step: bool = False) -> int:
        """Hybrid placement: every worker loads its engine from the actor's shards on its own
        device (workers/hybrid.py); the driver's host replica takes the policy head only (what
        the online drafter's trainer reads), from worker 0's answer. advance_step: the
        engines' step end in the same call (one round trip). `cluster/push_s` is this call's
        wall time."""
        start = time.perf_counter()
        version = self.host.policy_version + 1 if version is None else version
        self.last_syncs = get_all([w.sync_weights.remote(version, advance_step)
                                   for w in self.workers], "the weight sync")
        self.host.load_weights(self.last_syncs[0].head or [], version)
        if advance_step:
            self.host.advance_step()
        self.last_push_s = time.perf_counter() - start
        return version

    def load_drafter_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                             version: int | None = None, checksum: str | None = None,
                             held_by: int | None = None) -> int:
        """held_by (hybrid workers): the worker whose trainer member published these: every
        engine takes them from there over the workers' process group (HybridWorker.
        share_drafter), checked against `checksum`; else through the object store."""
        import ray
        named = [(name, t.detach().cpu()) for name, t in named_tensors]
        if self.hybrid and held_by is not None:
            version = (self.host.drafter_version or 0) + 1 if version is None else version
            share_drafter(self.workers, named, version, checksum, held_by)
            return self.host.load_drafter_weights(named, version, checksum)
        version = self.host.load_drafter_weights(named, version, checksum)   # checked here
        self._drafter = (ray.put(named), version, checksum)
        self._on_all(lambda w: w.load_drafter_weights.remote(*self._drafter))
        return version

    def fall_back_to_plain(self, reason: str) -> None:
        self.host.fall_back_to_plain(reason)
        self._sync_spec()

    def resume_speculation(self, spec: SpecConfig) -> None:
        self.host.resume_speculation(spec)
        self._sync_spec()

    def _sync_spec(self) -> None:
        spec, reason = self.host.spec, self.host.fallback_reason
        self._on_all(lambda w: w.set_spec.remote(spec, reason))

    def advance_step(self) -> None:
        self.host.advance_step()
        self._on_all(lambda w: w.advance_step.remote())

    def state_dict(self) -> dict:
        """Worker 0's engine state (what a local run resumes from), every worker's beside it."""
        import ray
        states = ray.get([w.state_dict.remote() for w in self.workers])
        return {**states[0], "replicas": states}

    def load_state_dict(self, state: dict) -> None:
        """A local run's state goes to every worker; a pool's, replica by replica (cycled
        when the worker count changed)."""
        import ray
        replicas = state.get("replicas") or [state]
        self.host.load_state_dict(replicas[0])
        ray.get([w.load_state_dict.remote(replicas[i % len(replicas)])
                 for i, w in enumerate(self.workers)])

    def _on_all(self, call: Callable[[Any], Any]) -> list[Any]:
        """call(worker) on every worker and wait; a worker found dead is replaced (and starts
        from the current state), so a broadcast never leaves a worker behind. The answers
        (None from a replaced worker)."""
        return self._wait([call(w) for w in self.workers])

    def _wait(self, futures: list[Any]) -> list[Any]:
        """Waits for calls made on the workers in order (len(workers) a round); a worker that
        died is replaced from the current state, which the failed call was part of. The
        answers, None where the worker died."""
        import ray
        replaced: set[int] = set()
        answers: list[Any] = [None] * len(futures)
        for i, future in enumerate(futures):
            k = i % len(self.workers)
            try:
                answers[i] = ray.get(future)
            except ray.exceptions.RayActorError as err:
                if k not in replaced:
                    print(f"cluster: rollout worker {k} died ({type(err).__name__}); "
                          "replacing it")
                    self.replace_worker(k)
                    replaced.add(k)
        return answers

    def replace_worker(self, k: int) -> None:
        import ray
        if self.hybrid:   # its actor rank died with it: only a checkpoint has that shard
            raise ActorRankError(f"hybrid worker {k} (actor rank {k}) died")
        if self.restarts >= self.cfg.max_worker_restarts:
            raise RuntimeError(f"rollout worker {k} died and cluster.max_worker_restarts="
                               f"{self.cfg.max_worker_restarts} replacements are used up")
        self.restarts += 1
        ray.kill(self.workers[k], no_restart=True)
        worker = self._start(k)
        calls = [worker.pid.remote()]
        for ref in self._weights or []:
            calls.append(worker.load_weights.remote(ref, self.host.policy_version))
        if self._drafter is not None:
            calls.append(worker.load_drafter_weights.remote(*self._drafter))
        calls.append(worker.set_spec.remote(self.host.spec, self.host.fallback_reason))
        calls.append(worker.load_state_dict.remote(self.host.state_dict()))
        ray.get(calls)
        self.workers[k] = worker

    def worker_pids(self) -> list[int]:
        import ray
        return ray.get([w.pid.remote() for w in self.workers])

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group
        if self.closed or not ray.is_initialized():
            return
        self.closed = True
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        remove_placement_group(self.group)
