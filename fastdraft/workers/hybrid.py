"""HybridWorker: one process per device (a Ray actor) holding that device's actor rank (FSDP2
shard, fp32 masters, AdamW; actor/rank.py) beside a full engine replica in the serving dtype
(workers/rollout_worker.py: generate, tails, drafter weights), or with rollout.tensor_parallel
k one rank of a replica that k consecutive workers form (models/tensor_parallel.py). The
workers are the actor's ranks (workers/hybrid_ranks.py carries the driver's calls to them) and
every one rolls out.

Weight sync stays on the device: after the update every worker gathers the full parameters
from the FSDP2 shards (an all-gather among the workers per FSDP unit) straight into its own
engine, cast to the serving dtype as they land (`engine.load_weights` copies in place; a
tensor-parallel rank copies its slices): no host
copy, no object store, no driver on the path. Between rollout and update the engine gives back
its KV cache and its CUDA graphs' pool (on a GPU: the update needs the memory; the weights
stay), and they stay given back through the sync: the weights land while the cache's memory
is free for the gather, and the next generate takes the cache back. Checkpoints are
sharded: every worker writes its shard of the masters and AdamW state, worker 0 the rest and
the publish (checkpoint/sharded.py), into the run directory, which every node sees at the same
path."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

from fastdraft.actor.rank import ActorRank, ActorSpec
from fastdraft.actor.sharding import broadcast_flat, free_port
from fastdraft.checkpoint import CheckpointManager, CheckpointWriteError, TrainState
from fastdraft.checkpoint.layout import step_dir_name
from fastdraft.checkpoint.sharded import ShardedActor
from fastdraft.errors import FastdraftError
from fastdraft.models.tensor_parallel import replica_of
from fastdraft.workers.rollout_worker import EngineFactory, RolloutWorker
from fastdraft.workers.trainer_actor import TRAINER

#: The policy tensors the driver's host replica takes after a sync: what the online drafter's
#: trainer reads of the policy (its embedding and head).
HEAD = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True, slots=True)
class WeightSync:
    """What one worker's sync did: seconds, bytes loaded into its engine, and the devices the
    gathered tensors were on when they landed (the engine's own: nothing went through the
    host)."""

    seconds: float
    nbytes: int
    devices: tuple[str, ...]
    head: list[tuple[str, torch.Tensor]] | None = None   # worker 0's: the policy head (HEAD)


def head_only(host: Any) -> Any:
    """The driver's host replica of hybrid workers with the policy's weights dropped but its
    head (HEAD, what the online drafter's trainer reads; an EAGLE drafter borrows it too):
    the workers hold the policy, the driver only what it reads (16 GB less at 8B)."""
    with torch.no_grad():
        for name, param in host.model.named_parameters():
            if name not in HEAD:
                param.data = torch.empty(0, dtype=param.dtype)
    return host


def rendezvous() -> tuple[str, int]:
    """(this node's IP as Ray knows it, a free port here): where rank 0's process group
    listens. Run as a Ray task in rank 0's bundle, so the address is that node's."""
    import ray
    return ray.util.get_node_ip_address(), free_port()


class HybridWorker(RolloutWorker):
    def __init__(self, make_engine: EngineFactory, device: str, threads: int, spec: ActorSpec,
                 rank: int, release_kv: bool | None = None, tensor_parallel: int = 1) -> None:
        """release_kv: give the KV cache back while the actor updates (default: on a GPU).
        tensor_parallel k > 1: this worker's engine is rank rank % k of the replica that
        workers rank - rank % k .. + k - 1 form (models/tensor_parallel.py); its weight sync
        lands the slices of the gathered tensors that rank holds."""
        super().__init__(make_engine, device, threads,
                         replica_of(rank, tensor_parallel) if tensor_parallel > 1 else None)
        self.release_kv = device.startswith("cuda") if release_kv is None else release_kv
        self.checkpoints: CheckpointManager | None = None   # worker 0's writes
        self.member: Any = None   # the online drafter's trainer member (start_member)
        # Ray gives a GPU worker one GPU, which it sees as cuda:0; the engine has it too.
        self.actor = ActorRank(spec, rank, "cuda:0" if spec.device.startswith("cuda")
                               else None)

    # ------------------------------------------------------------- the drafter trainer member
    # Calls on the TRAINER thread (workers/trainer_actor.InWorker): beside a running generate
    # or update, in the order made. Its training thread computes on this worker's device.
    @ray.method(concurrency_group=TRAINER)
    def start_member(self, body: type, setup: Any, *args: Any) -> None:
        """The online drafter's trainer member here (a TrainerActor or a data-parallel
        GroupMember: workers/trainer_group.py); one that was here ends first (a restart)."""
        self.stop_member()
        self.member = body(setup, *args)

    @ray.method(concurrency_group=TRAINER)
    def member_call(self, method: str, *args: Any) -> Any:
        if self.member is None:
            raise RuntimeError(f"member_call({method!r}): this worker has no trainer member")
        return getattr(self.member, method)(*args)

    @ray.method(concurrency_group=TRAINER)
    def stop_member(self) -> None:
        if self.member is not None:
            self.member.stop()
            self.member = None

    def rank_call(self, name: str, args: tuple) -> Any:
        """ActorRank.<name>(*args): the driver's call of every rank (workers/ranks.py)."""
        return getattr(self.actor, name)(*args)

    def sync_weights(self, version: int, advance_step: bool = False) -> WeightSync:
        """The actor's new weights into this worker's engine, on the device, one FSDP unit's
        all-gather at a time where the compute dtype allows (collective: every worker syncs at
        once, the gathers pair up). advance_step: the engine's step end too (the loop's, in
        the same call). Worker 0's answer carries the policy head for the driver."""
        start = time.perf_counter()
        devices: set[str] = set()
        nbytes = 0

        def landing() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal nbytes
            for name, tensor in gathered.named_parameters():
                devices.add(str(tensor.device))
                nbytes += tensor.numel() * tensor.element_size()
                yield name, tensor

        gathered = self.actor.gathered_for(next(self.engine.model.parameters()).dtype)
        try:
            self.engine.load_weights(landing(), version)
        finally:
            gathered.finish()   # a failed load: the peers' gathers still pair up
        if advance_step:
            self.engine.advance_step()
        return WeightSync(time.perf_counter() - start, nbytes, tuple(sorted(devices)),
                          self.policy_head() if self.actor.rank == 0 else None)

    def share_drafter(self, layout: list[tuple[str, tuple[int, ...], torch.dtype]],
                      version: int, checksum: str, src: int) -> str | None:
        """Collective: the drafter worker `src`'s trainer member published last goes from its
        process into every worker's engine over the workers' process group, on the device
        (NCCL between GPUs): no object store, no driver on the path. `layout`: the published
        tensors' names, shapes and dtypes. Every engine checks the published checksum before
        it loads anything; a mismatch is returned (every worker got the same bytes), not
        raised: the broadcast has ended on every rank either way."""
        device = self.actor.device
        if self.actor.rank == src:
            tensors = self._published(layout)
        else:   # filled by the broadcast
            tensors = [torch.empty(s, dtype=d, device=device) for _, s, d in layout]
        if self.actor.world > 1:
            broadcast_flat(tensors, src)
        try:
            self.engine.load_drafter_weights(zip([n for n, _, _ in layout], tensors), version,
                                             checksum=checksum)
        except FastdraftError as err:
            return str(err)
        return None

    def _published(self, layout: list[tuple[str, tuple[int, ...], torch.dtype]]
                   ) -> list[torch.Tensor]:
        """What this worker's member published last, on the device; zeros when it has nothing
        that fits `layout` (they go out all the same, and every checksum fails)."""
        held = self.member.last_published() if self.member is not None else []
        if [(tuple(t.shape), t.dtype) for t in held] != [(s, d) for _, s, d in layout]:
            return [torch.zeros(s, dtype=d, device=self.actor.device) for _, s, d in layout]
        return [t.to(self.actor.device) for t in held]

    def save_checkpoint(self, root: str, keep: int, step: int, rest: dict[str, Any]
                        ) -> tuple[float, float]:
        """Collective: every worker writes its own shard of the masters and AdamW state
        (torch.distributed.checkpoint, into worker 0's temp dir for checkpoint `step`); worker
        0 then adds `rest` (the driver's part: config, drafter, extra, rng) and the LR schedule
        through a CheckpointManager of its own, which publishes the whole in the background
        (checkpoint/sharded.py). No weight leaves its rank. (seconds the call took, the
        previous write's seconds). A shard this worker could not write is a
        CheckpointWriteError (the driver ends the run with it: a disk, not a lost rank)."""
        start = time.perf_counter()
        into = None
        if self.actor.rank == 0:
            if self.checkpoints is None:
                self.checkpoints = CheckpointManager(Path(root).parent, keep)
            into = self.checkpoints.temp_dir(step)   # after the previous write
        try:
            written = self.actor.save_shards(into)
        except OSError as err:
            if into is not None:   # nothing of it is published
                shutil.rmtree(into, ignore_errors=True)
            raise CheckpointWriteError(Path(root) / step_dir_name(step), err) from err
        if written is not None:
            schedule = self.actor.schedule_state()
            self.checkpoints.save(step, TrainState(
                model=ShardedActor(self.actor.model.config), optimizer={},
                scheduler=schedule["scheduler"], step=step, config=rest["config"],
                drafter=rest["drafter"], rng=rest["rng"],
                extra={**rest["extra"], "loss_scale": schedule["loss_scale"]}),
                into=written[0], shards=written[1])
        previous = self.checkpoints.last_write_s if self.checkpoints is not None else 0.0
        return time.perf_counter() - start, previous

    def wait_checkpoint(self) -> CheckpointWriteError | None:
        """Worker 0's pending checkpoint write on disk; its error returned (a value, whole on the
        driver, which raises it: not a failed call, which would read as a lost rank)."""
        try:
            if self.checkpoints is not None:
                self.checkpoints.wait()
        except CheckpointWriteError as err:
            return err
        return None

    def poll_checkpoint(self) -> CheckpointWriteError | None:
        """wait_checkpoint() without waiting: a write still running is None (looked at again at
        the next step boundary)."""
        try:
            if self.checkpoints is not None:
                self.checkpoints.poll()
        except CheckpointWriteError as err:
            return err
        return None

    def policy_head(self) -> list[tuple[str, torch.Tensor]]:
        """The engine's embedding and head (HEAD), for the driver's host replica."""
        params = dict(self.engine.model.named_parameters())
        return [(name, params[name].detach().cpu()) for name in HEAD if name in params]

    def sleep(self) -> int:
        """On a GPU: the KV cache (and the graphs' pool) back for the update and the sync on
        this device (the weights stay: the sync overwrites them in place; the next generate
        takes the cache back); the bytes given back. On the CPU nothing: the cache
        lives in the one RAM the update uses too, and allocating and zeroing it again costs
        more than it frees (0.18 s a step on the tiny recipe; on a GPU a memset of the cache)."""
        if not self.release_kv:
            return 0
        return self.engine.sleep(weights=False)
