"""The warm-up's data-parallel members: member 0 in the driver (it shows the progress bar and
saves the state), members 1.. Ray actors, one a device. Each trains on its own share of the
captured samples (every world-th spill record) and they sum their gradients weighted by tokens
over one gloo process group, so all of them take the step a single trainer would take on their
batches together (trainer/data_parallel.py) and stay identical."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fastdraft.databuffer import DataBuffer
from fastdraft.databuffer.spill import load_records, read_manifest
from fastdraft.drafter import Drafter
from fastdraft.trainer.data_parallel import token_weighted_grads
from fastdraft.trainer.spot import PolicyHead, SpotConfig, SpotTrainer
from fastdraft.trainer.warmup_train import train_warmup


@dataclass(frozen=True, kw_only=True, slots=True)
class MemberJob:
    """What every member trains: the captured samples, the drafter to start from, the
    policy's head, the trainer's settings, the micro-steps in all."""

    spill_dir: Path
    work_dir: Path
    drafter: Drafter           # detached: each member attaches it to its own head
    head: PolicyHead
    spot: SpotConfig
    steps: int
    save_every: int = 50
    num_threads: int = 1


def member_trainer(job: MemberJob, rank: int, world: int) -> SpotTrainer:
    """A SpotTrainer over this member's share of the samples."""
    records = read_manifest(job.spill_dir).records[rank::world]
    buffer = DataBuffer(2**62, offset_mix=0.0, seed=rank)
    for sample in load_records(job.spill_dir, records):
        buffer.add(sample)
    return SpotTrainer(job.drafter, job.head, buffer, job.spot)


def train_member(job: MemberJob, rank: int, world: int, store: dist.Store | None,
                 progress: bool = True) -> SpotTrainer:
    """Trains this member to job.steps; `store` (None: one member) is the group's rendezvous."""
    torch.set_num_threads(job.num_threads)
    trainer = member_trainer(job, rank, world)
    reduce = None
    if world > 1:
        pg = dist.ProcessGroupGloo(dist.PrefixStore("warmup/", store), rank, world)
        reduce = token_weighted_grads(pg)
    train_warmup(trainer, job.steps, job.work_dir, reduce=reduce, lead=rank == 0,
                 save_every=job.save_every, progress=progress)
    return trainer


class WarmupMember:
    """Members 1.. of the group, a Ray actor each (workers/warmup_member.remote_member)."""

    def train(self, job: MemberJob, rank: int, world: int, store_at: tuple[str, int]
              ) -> tuple[dict[str, torch.Tensor], int]:
        """Its trained tensors (the same as every member's: the group's check) and the tokens
        it trained on."""
        store = dist.TCPStore(store_at[0], store_at[1], is_master=False)
        trainer = train_member(job, rank, world, store)
        return ({n: p.detach().cpu() for n, p in trainer.drafter.named_parameters()},
                trainer.stats.tokens)


def remote_member(num_cpus: float, num_gpus: float):
    """The Ray actor class of a member, reserving its device."""
    import ray
    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(WarmupMember)
