"""`fastdraft drafter warmup` on the devices: `workers` data-parallel members
(workers/warmup_group.py: one inline on the given device; more a placement group, a GPU each on
GPU nodes) each serve their share of the warm-up rollouts with the rollout engine and capture the
policy's hidden states as they go (trainer/warmup_capture.py), then train the drafter together
on what they captured (workers/warmup_member.py). Everything lands in a work directory, so a
killed warm-up started again with `resume` skips the chunks it captured and continues from its
last saved trainer state; the drafter is saved (atomically) only at the end."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from fastdraft.drafter import Drafter, build_drafter, load_drafter, save_drafter
from fastdraft.drafter.warmup import WarmupConfig, WarmupReport, frequent_tokens
from fastdraft.engine import SamplingParams
from fastdraft.errors import FastdraftError
from fastdraft.trainer.spot import PolicyHead, SpotConfig
from fastdraft.utils.outputs import mark, remove_output
from fastdraft.workers.warmup_group import WarmupGroup
from fastdraft.workers.warmup_member import CaptureJob, MemberJob, capture_dir


@dataclass(frozen=True, kw_only=True, slots=True)
class DevicePlan:
    """Where the warm-up runs: device and dtype of the engine and the members, how many
    members (one a device on a GPU node; processes on a CPU), the packed micro-batch, the
    members' compute dtype (fp32 masters and AdamW either way)."""

    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    workers: int = 1
    token_budget: int = 4096
    max_batch_size: int = 64
    save_every: int = 50
    compute_dtype: str = "float32"   # the members' forward/backward (bfloat16: autocast)

    def __post_init__(self) -> None:
        if self.workers < 1 or self.token_budget < 2 or self.save_every < 1:
            raise FastdraftError("drafter warmup: --workers and --save-every must be >= 1, "
                                 "--token-budget >= 2")


def device_warmup(policy_dir: Path, out_dir: Path, prompts: list[list[int]], cfg: WarmupConfig,
                  plan: DevicePlan, work_dir: Path, *, init: Path | None = None,
                  resume: bool = False, progress: bool = True,
                  overwrite: bool = False) -> WarmupReport:
    """Warms up a drafter for the policy at policy_dir and saves it to out_dir (replacing
    only an earlier drafter unless `overwrite`: utils/outputs.py)."""
    if not resume:   # a fresh warm-up; --resume keeps what a killed one left
        remove_output(work_dir, "warmup", "--work-dir", overwrite)
    work_dir.mkdir(parents=True, exist_ok=True)
    mark(work_dir, "warmup")
    longest = max(map(len, prompts)) + cfg.max_new_tokens + 1
    params = SamplingParams(temperature=cfg.rollout_temperature, seed=cfg.seed,
                            max_new_tokens=cfg.max_new_tokens)
    capture = CaptureJob(policy_dir=policy_dir, prompts=prompts, params=params,
                         aux_layers=_aux_layers(cfg, policy_dir, init), dtype=plan.dtype,
                         max_batch_size=plan.max_batch_size, max_seq_len=longest,
                         work_dir=work_dir, chunk=min(64, -(-len(prompts) // plan.workers)))
    group = WarmupGroup(plan.device, plan.workers)
    try:
        mine = sum(min(capture.chunk, len(prompts) - first)   # member 0's chunks
                   for first in range(0, len(prompts), capture.chunk * plan.workers))
        with tqdm(total=mine, unit="rollout", desc="capture", disable=not progress,
                  dynamic_ncols=True) as bar:
            captured = group.call("capture", capture, lead_kwargs={"progress": bar})
        torch.manual_seed(cfg.seed)
        drafter = _initial_drafter(cfg, group.lead.head, longest, init)
        dirs = [capture_dir(work_dir, r) for r in range(plan.workers)]
        if cfg.draft_vocab is not None and drafter.head is None:
            drafter.draft_token_ids = _draft_vocabulary(dirs, cfg.draft_vocab)
        spot = SpotConfig(loss=cfg.kind, lr=cfg.lr, lr_warmup_steps=cfg.warmup_steps,
                          token_budget=max(plan.token_budget, longest), num_steps=cfg.ttt_steps,
                          device=group.lead.device, compute_dtype=plan.compute_dtype)
        _check_member_fits(drafter, spot, plan, dirs)
        job = MemberJob(work_dir=work_dir, drafter=drafter.detached(), spot=spot,
                        steps=cfg.steps, save_every=plan.save_every)
        start = time.perf_counter()
        tokens = group.call("train", job, group.store_at if plan.workers > 1 else None,
                            lead_kwargs={"progress": progress})
        train_s = time.perf_counter() - start
        digests = group.call("digest")
        if len(set(digests)) > 1:
            raise RuntimeError(f"the warm-up members ended with different weights (digests "
                               f"{digests}): their data-parallel steps diverged")
        trainer = group.lead.trainer
    finally:
        group.close()
    trained = trainer.drafter.to("cpu", torch.float32)
    save_drafter(trained, out_dir, overwrite=overwrite,
                 extra={"warmup": asdict(cfg), "warmup_device": plan.device,
                        "warmup_workers": plan.workers})
    return WarmupReport(out_dir, cfg.kind, sum(c.samples for c in captured), sum(tokens),
                        max(c.seconds for c in captured), train_s,
                        trainer.stats.last.get("loss", float("nan")),
                        trainer.stats.last.get("top1_acc", float("nan")),
                        sum(c.tokens for c in captured))


def _check_member_fits(drafter: Drafter, spot: SpotConfig, plan: DevicePlan,
                       spill_dirs: list[Path]) -> None:
    """A member's memory on its device, planned as a run plans its trainer member
    (trainer/memory_plan.py; on a CPU its share of the captured samples too), before training."""
    from fastdraft.config.sections import OnlineDrafterConfig
    from fastdraft.trainer.memory_plan import TrainerPlan
    from fastdraft.utils.device_memory import device_capacity, gb
    width = plan.dtype.itemsize
    params = sum(p.numel() for p in drafter.parameters())
    on_cpu = torch.device(plan.device).type == "cpu"
    samples = max(sum(f.stat().st_size for f in d.glob("shard-*")) for d in spill_dirs)
    member = TrainerPlan.of(drafter.config, OnlineDrafterConfig(
        token_budget=spot.token_budget, buffer_mb=max(samples, 1) / 2**20), params * width,
        width, on_cpu)
    capacity = device_capacity(plan.device)
    print(f"warm-up member memory plan ({plan.device}): {gb(member.total)} of "
          f"{gb(capacity.usable)} usable (drafter state {gb(member.state)}, policy head "
          f"{gb(member.head)}, a micro-step {gb(member.transient)}"
          + (f", samples {gb(member.buffer)})" if on_cpu else ")"))
    if member.total > capacity.usable:
        raise FastdraftError(f"a warm-up member needs {gb(member.total)} on {plan.device} but "
                             f"{gb(capacity.usable)} is usable: lower --token-budget (now "
                             f"{spot.token_budget}), or --draft-vocab")


def _aux_layers(cfg: WarmupConfig, policy_dir: Path, init: Path | None) -> tuple[int, ...]:
    """The policy layers whose inputs the drafter reads (what the engine captures)."""
    from fastdraft.drafter.checkpoint import CONFIG_FILE, saved_options
    from fastdraft.models import ModelConfig
    config = ModelConfig.from_pretrained(policy_dir)
    options = {} if init is None else saved_options(json.loads((init / CONFIG_FILE).read_text()))
    with torch.device("meta"):
        return tuple(build_drafter(cfg.kind, config, 1, **options).aux_layers)


def _initial_drafter(cfg: WarmupConfig, head: PolicyHead, max_positions: int,
                     init: Path | None) -> Drafter:
    """A fresh drafter of cfg.kind, or the one at `init` (a fastdraft drafter; engine layouts
    are imported first by the caller) to train on."""
    if init is None:
        return build_drafter(cfg.kind, head.config, max_positions)
    drafter = load_drafter(init, head, max_positions)
    if drafter.kind != cfg.kind:
        raise FastdraftError(f"--init {init} is an {drafter.kind} drafter but --kind is "
                             f"{cfg.kind}: pass --kind {drafter.kind}")
    return drafter.float()


def _draft_vocabulary(spill_dirs: list[Path], n: int) -> torch.Tensor:
    """The n most frequent answer tokens of the captured rollouts."""
    from fastdraft.databuffer.spill import load_spill
    answers = [s.token_ids[s.loss_mask].tolist() for d in spill_dirs for s in load_spill(d)]
    return frequent_tokens(answers, n)
