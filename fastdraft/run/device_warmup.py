"""`fastdraft drafter warmup` on the devices: the rollout engine generates the warm-up rollouts
and captures the policy's hidden states as it goes (trainer/warmup_capture.py), then `workers`
data-parallel members train the drafter on them (workers/warmup_member.py: member 0 here, the
others Ray actors, one a device). Everything lands in a work directory, so a killed warm-up
started again with `resume` skips the chunks it captured and continues from its last saved
trainer state; the drafter is saved (atomically) only at the end."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from fastdraft.drafter import Drafter, build_drafter, load_drafter, save_drafter
from fastdraft.drafter.warmup import WarmupConfig, WarmupReport, frequent_tokens
from fastdraft.engine import RolloutEngine, SamplingParams
from fastdraft.errors import FastdraftError
from fastdraft.trainer.spot import PolicyHead, SpotConfig
from fastdraft.trainer.warmup_capture import capture_rollouts
from fastdraft.workers.warmup_member import MemberJob, remote_member, train_member


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
        if self.workers > 1 and torch.device(self.device).type != "cpu":
            raise FastdraftError("drafter warmup: data-parallel members (--workers > 1) run on "
                                 "the CPU only so far; on a GPU use --workers 1")


def device_warmup(policy_dir: Path, out_dir: Path, prompts: list[list[int]], cfg: WarmupConfig,
                  plan: DevicePlan, work_dir: Path, *, init: Path | None = None,
                  resume: bool = False, progress: bool = True) -> WarmupReport:
    """Warms up a drafter for the policy at policy_dir and saves it to out_dir."""
    if work_dir.exists() and not resume:
        shutil.rmtree(work_dir)   # a fresh warm-up; --resume keeps what a killed one left
    work_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    longest = max(map(len, prompts)) + cfg.max_new_tokens + 1
    engine = RolloutEngine(policy_dir, device=plan.device, dtype=plan.dtype,
                           max_batch_size=plan.max_batch_size, max_seq_len=longest,
                           capture_aux_layers=_aux_layers(cfg, policy_dir, init))
    drafter = _initial_drafter(cfg, engine, init)
    params = SamplingParams(temperature=cfg.rollout_temperature, seed=cfg.seed,
                            max_new_tokens=cfg.max_new_tokens)
    with tqdm(total=len(prompts), unit="rollout", desc="capture", disable=not progress,
              dynamic_ncols=True) as bar:
        capture = capture_rollouts(engine, prompts, params, work_dir / "capture", progress=bar)
    head = PolicyHead.of(engine.model)
    del engine
    if cfg.draft_vocab is not None and drafter.head is None:
        drafter.draft_token_ids = _draft_vocabulary(work_dir / "capture", cfg.draft_vocab)
    spot = SpotConfig(loss=cfg.kind, lr=cfg.lr, lr_warmup_steps=cfg.warmup_steps,
                      token_budget=max(plan.token_budget, longest), num_steps=cfg.ttt_steps,
                      device=plan.device, compute_dtype=plan.compute_dtype)
    job = MemberJob(spill_dir=work_dir / "capture", work_dir=work_dir, drafter=drafter.detached(),
                    head=head, spot=spot, steps=cfg.steps, save_every=plan.save_every)
    _check_member_fits(drafter, spot, plan, work_dir / "capture")
    start = time.perf_counter()
    trainer = _train(job, plan, progress)
    train_s = time.perf_counter() - start
    trained = trainer.drafter.to("cpu", torch.float32)
    save_drafter(trained, out_dir, extra={"warmup": asdict(cfg), "warmup_device": plan.device,
                                          "warmup_workers": plan.workers})
    stats = trainer.stats
    return WarmupReport(out_dir, cfg.kind, capture.samples, stats.tokens, capture.seconds,
                        train_s, stats.last.get("loss", float("nan")),
                        stats.last.get("top1_acc", float("nan")), capture.tokens)


def _check_member_fits(drafter: Drafter, spot: SpotConfig, plan: DevicePlan,
                       spill_dir: Path) -> None:
    """A member's memory on its device, planned as a run plans its trainer member
    (trainer/memory_plan.py; on a CPU its share of the captured samples too), before training."""
    from fastdraft.config.sections import OnlineDrafterConfig
    from fastdraft.trainer.memory_plan import TrainerPlan
    from fastdraft.utils.device_memory import device_capacity, gb
    width = plan.dtype.itemsize
    params = sum(p.numel() for p in drafter.parameters())
    on_cpu = torch.device(plan.device).type == "cpu"
    samples = sum(f.stat().st_size for f in spill_dir.glob("shard-*")) // plan.workers
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


def _initial_drafter(cfg: WarmupConfig, engine: RolloutEngine, init: Path | None) -> Drafter:
    """A fresh drafter of cfg.kind, or the one at `init` (a fastdraft drafter; engine layouts
    are imported first by the caller) to train on."""
    max_positions = engine.model.rope.cos.shape[0]
    if init is None:
        return build_drafter(cfg.kind, engine.config, max_positions)
    drafter = load_drafter(init, engine.model, max_positions)
    if drafter.kind != cfg.kind:
        raise FastdraftError(f"--init {init} is an {drafter.kind} drafter but --kind is "
                             f"{cfg.kind}: pass --kind {drafter.kind}")
    return drafter.float()


def _draft_vocabulary(spill_dir: Path, n: int) -> torch.Tensor:
    """The n most frequent answer tokens of the captured rollouts."""
    from fastdraft.databuffer.spill import load_spill
    samples = load_spill(spill_dir)
    answers = [s.token_ids[s.loss_mask].tolist() for s in samples]
    return frequent_tokens(answers, n)


def _train(job: MemberJob, plan: DevicePlan, progress: bool):
    """Member 0 here, members 1.. as Ray actors (a device each on a GPU node)."""
    if plan.workers == 1:
        return train_member(job, 0, 1, None, progress)
    import ray

    from fastdraft.cluster.ray_cluster import connect
    from fastdraft.config.sections import ClusterConfig
    started = connect(ClusterConfig(), plan.workers - 1)
    host = ray.util.get_node_ip_address()   # where the members reach this process
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    member = remote_member(num_cpus=1, num_gpus=0)
    others = [member.remote() for _ in range(plan.workers - 1)]
    pending = [m.train.remote(job, rank, plan.workers, (host, store.port))
               for rank, m in enumerate(others, start=1)]
    try:
        trainer = train_member(job, 0, plan.workers, store, progress)
        mine, tokens = dict(trainer.drafter.named_parameters()), trainer.stats.tokens
        for rank, (theirs, their_tokens) in enumerate(ray.get(pending), start=1):
            if any(not torch.equal(mine[n].detach().cpu(), t) for n, t in theirs.items()):
                raise RuntimeError(f"warm-up member {rank} ended with other weights than "
                                   "member 0: the data-parallel steps diverged")
            tokens += their_tokens
        trainer.stats.tokens = tokens   # the group's: what the report counts
    finally:
        for m in others:
            ray.kill(m)
        if started:
            ray.shutdown()
    return trainer
