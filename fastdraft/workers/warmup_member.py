"""One data-parallel member of the drafter warm-up (run/device_warmup.py): member 0 inline in the
driver (it shows the progress bars and saves the trainer state), members 1.. the same class as
Ray actors, a device each (workers/warmup_group.py). A member first serves its share of the
rollouts with an engine of its own on its device and captures their hidden states there
(trainer/warmup_capture.py: chunks r, r + world, ... of the prompts, into its own spill
directory), keeps the policy's head, frees the engine, and then trains on its own samples; the
members sum their gradients weighted by tokens over one gloo process group
(trainer/data_parallel.py), so all take the step a single trainer would take on their batches
together and stay identical."""

from __future__ import annotations

import dataclasses
import datetime
import gc
import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fastdraft.databuffer import DataBuffer
from fastdraft.databuffer.spill import load_records, read_manifest
from fastdraft.drafter import Drafter
from fastdraft.engine import RolloutEngine, SamplingParams
from fastdraft.trainer.data_parallel import token_weighted_grads
from fastdraft.trainer.spot import PolicyHead, SpotConfig, SpotTrainer
from fastdraft.trainer.warmup_capture import CaptureReport, capture_rollouts
from fastdraft.trainer.warmup_train import train_warmup


@dataclass(frozen=True, kw_only=True, slots=True)
class CaptureJob:
    """What every member serves: all the prompts (each member its chunks of them), how."""

    policy_dir: Path
    prompts: list[list[int]]
    params: SamplingParams
    aux_layers: tuple[int, ...]      # the policy layers whose inputs the drafter reads
    dtype: torch.dtype               # the engine's
    max_batch_size: int
    max_seq_len: int
    work_dir: Path
    chunk: int = 64


@dataclass(frozen=True, kw_only=True, slots=True)
class MemberJob:
    """What every member trains: the drafter to start from (detached: each member attaches it
    to its own copy of the policy's head), the trainer's settings, the micro-steps in all."""

    work_dir: Path
    drafter: Drafter
    spot: SpotConfig
    steps: int
    save_every: int = 50


#: How long a member waits in a gradient sum for the others (one that died fails it then).
GROUP_TIMEOUT = datetime.timedelta(minutes=10)


def capture_dir(work_dir: Path, rank: int) -> Path:
    return work_dir / f"capture-{rank}"


class WarmupMember:
    """Member `rank` of `world`; device: where it serves and trains (as its process names it)."""

    def __init__(self, device: str, rank: int = 0, world: int = 1, num_threads: int = 1) -> None:
        torch.set_num_threads(num_threads)
        self.device, self.rank, self.world = device, rank, world
        self.head: PolicyHead | None = None
        self.trainer: SpotTrainer | None = None

    def capture(self, job: CaptureJob, progress=None) -> CaptureReport:
        """Serves and captures this member's chunks of the prompts; keeps the policy's head."""
        engine = RolloutEngine(job.policy_dir, device=self.device, dtype=job.dtype,
                               max_batch_size=job.max_batch_size, max_seq_len=job.max_seq_len,
                               capture_aux_layers=job.aux_layers)
        self.head = PolicyHead.of(engine.model)
        report = capture_rollouts(engine, job.prompts, job.params,
                                  capture_dir(job.work_dir, self.rank), chunk=job.chunk,
                                  member=(self.rank, self.world), progress=progress)
        del engine   # its weights and KV pool: the device is the trainer's from here on
        gc.collect()
        if torch.device(self.device).type == "cuda":
            torch.cuda.empty_cache()
        return report

    def train(self, job: MemberJob, store_at: tuple[str, int] | None = None,
              progress: bool = False) -> int:
        """Trains this member to job.steps on its captured samples; store_at: the group's
        TCPStore (None: the only member). Returns the tokens it trained on."""
        if self.head is None:
            raise RuntimeError("a warm-up member trains after its capture (it holds the head)")
        rank, world = self.rank, self.world
        buffer = DataBuffer(2**62, offset_mix=0.0, seed=rank)
        spill = capture_dir(job.work_dir, rank)
        for sample in load_records(spill, read_manifest(spill).records):
            buffer.add(sample)
        spot = dataclasses.replace(job.spot, device=self.device)
        self.trainer = SpotTrainer(job.drafter, self.head, buffer, spot)
        reduce = None
        if world > 1:
            store = dist.TCPStore(store_at[0], store_at[1], is_master=False)
            pg = dist.ProcessGroupGloo(dist.PrefixStore("warmup/", store), rank, world,
                                       GROUP_TIMEOUT)
            reduce = token_weighted_grads(pg)
        train_warmup(self.trainer, job.steps, job.work_dir, reduce=reduce, lead=rank == 0,
                     save_every=job.save_every, progress=progress)
        return self.trainer.stats.tokens

    def digest(self) -> str:
        """A digest of the trained tensors' bytes: every member's must be the same."""
        sha = hashlib.sha256()
        for name, param in self.trainer.drafter.named_parameters():
            sha.update(name.encode())
            sha.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return sha.hexdigest()
