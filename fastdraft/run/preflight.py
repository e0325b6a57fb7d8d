"""Every check a run makes before its first step, in one function that `fastdraft run` and
`fastdraft run --dry-run` both call, so a dry run that passes means the run starts.

In order, each a one-line user error: the recipe's local paths; the policy's files (a supported
architecture, a tokenizer, whole weight files); the drafter it needs; the devices and the actor's
ranks against them; the rollout backend installed; the Ray cluster's address answering; every
row of a prompt file. Nothing is written and nothing spawned until these pass. Then the run
dir is proven writable, the policy resolved (a run trains the bootstrap policy and warms up its
drafter when they are not cached; a dry run plans from the cache or says what to do), its
tokenizer loaded, the prompts' lengths checked, and the memory plan checked against the device.

A dry run on a machine without the recipe's GPUs plans for a node of them: it cannot check the
devices there and says so."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastdraft.actor.memory_plan import RunPlan, check_run_plan
from fastdraft.config import RunConfig
from fastdraft.data.prompts import PromptSource
from fastdraft.errors import (
    FastdraftError,
    Place,
    check_creatable,
    check_free_space,
    existing_ancestor,
    writable_dir,
)
from fastdraft.run.inputs import (
    check_devices,
    check_drafter_source,
    check_paths,
    check_policy_files,
    load_tokenizer,
    resolve_drafter,
    resolve_policy,
    rollout_seq_len,
)
from fastdraft.utils.device_memory import Capacity, device_capacity


@dataclass(frozen=True)
class RunInputs:
    """What a run is built from, checked: the policy, its tokenizer and drafter, the prompts,
    the sequence length and the memory plan that fits."""

    policy_dir: Path
    drafter_dir: Path | None
    tokenizer: Any
    prompts: PromptSource
    max_seq_len: int
    plan: RunPlan


def preflight(cfg: RunConfig, capacity: Capacity | None = None, cache_dir: Path | None = None,
              run_dir: Place | None = None, dry: bool = False) -> RunInputs:
    """The run's inputs, every check passed (FastdraftError / FileNotFoundError otherwise).
    capacity: the device the plan must fit (default: what is free on model.device now).
    dry: plan from what is cached (no bootstrap training, no drafter warm-up) and print the
    engine's plan too; run_dir: proven writable before any work, and its disk checked for a
    checkpoint once the plan is known."""
    check_paths(cfg)
    check_policy_files(cfg)
    check_drafter_source(cfg)
    if not dry or devices_here(cfg):
        check_devices(cfg)
        check_ranks(cfg)
    else:
        print(f"devices not checked: {cfg.model.device} planned for a node of "
              f"{cfg.actor.num_ranks} GPU(s), and this machine has none (nor the run "
              "directory's free space: the node's disk is another)")
    check_backend(cfg)
    if cfg.cluster.backend == "ray":
        from fastdraft.cluster.ray_cluster import check_address
        check_address(cfg.cluster)
    rows = None
    if cfg.data.path is not None:
        from fastdraft.data.files import load_prompts
        rows = load_prompts(Path(cfg.data.path).expanduser(), cfg.data.prompt_key,
                            cfg.data.answer_key)
    max_seq_len = rollout_seq_len(cfg)
    if run_dir is not None:   # a read-only / full disk or a file in the way: one line, now
        writable_dir(run_dir) if not dry else check_creatable(run_dir)
    policy_dir = cached_policy(cfg, cache_dir) if dry else resolve_policy(cfg, cache_dir)
    tokenizer = load_tokenizer(policy_dir, "model.path" if cfg.model.path else "the policy")
    prompts = PromptSource(cfg.data, tokenizer, max_seq_len - cfg.rollout.max_new_tokens, rows)
    if dry:   # a drafter the run would warm up is planned from drafter.kind
        drafter_dir = Path(cfg.drafter.path).expanduser() if cfg.drafter.path else None
    else:
        drafter_dir = resolve_drafter(cfg, policy_dir, None if run_dir is None
                                      else run_dir.path / "imported-drafter")
    check_drafter_fits_policy(cfg, policy_dir, drafter_dir)
    from fastdraft.run.dry_run import plan_run, smallest_tensor_parallel
    # Hybrid workers compute on every GPU and the driver on none: it reads the figures in a
    # child process, so it never makes a CUDA context (utils/device_memory.py).
    capacity = capacity or device_capacity(cfg.model.device,
                                           in_child=cfg.cluster.placement == "hybrid")
    plan = plan_run(cfg, policy_dir, drafter_dir, max_seq_len)
    print("\n".join([*(plan.engine.lines(capacity) if dry else ()), *plan.actor.lines(),
                     *plan.lines(capacity.usable)]))
    tp = (smallest_tensor_parallel(cfg, policy_dir, drafter_dir, max_seq_len, capacity.usable)
          if dry or not plan.fits(capacity.usable) else None)
    if dry and tp is not None:
        print(f"tensor parallelism: the fewest devices an engine replica fits on is {tp} "
              f"(rollout.tensor_parallel={tp}; this recipe: {cfg.rollout.tensor_parallel})")
    try:
        check_run_plan(plan, capacity.usable)   # the trainer members' bytes too
    except FastdraftError as err:
        if tp is None or tp == cfg.rollout.tensor_parallel:
            raise
        raise FastdraftError(f"{err}; or split each engine replica over {tp} hybrid workers: "
                             f"rollout.tensor_parallel={tp} fits") from None
    if run_dir is not None and (not dry or devices_here(cfg)):
        check_free_space(Place(existing_ancestor(run_dir.path), run_dir.setting),
                         int(1.1 * plan.actor.host), "a checkpoint (fp32 weights and "
                         "AdamW moments)")
    return RunInputs(policy_dir, drafter_dir, tokenizer, prompts, max_seq_len, plan)


def check_drafter_fits_policy(cfg: RunConfig, policy_dir: Path, drafter_dir: Path | None
                              ) -> None:
    """The drafter the run serves fits the policy (what loading it refuses, from its files: an
    engine directory was checked as it was read), and the online trainer's loss fits its
    kind."""
    if drafter_dir is None or not (drafter_dir / "drafter_config.json").is_file():
        kind = cfg.drafter.kind   # the drafter a run warms up (an engine directory: EAGLE-3)
        if drafter_dir is not None:
            from fastdraft.export.imports import engine_layout
            kind = "eagle1" if engine_layout(drafter_dir) == "eagle1" else "eagle3"
    else:
        from fastdraft.drafter.checkpoint import check_drafter_fits, read_drafter_config
        from fastdraft.models import ModelConfig
        check_drafter_fits(drafter_dir, ModelConfig.from_pretrained(policy_dir), "drafter.path")
        kind = read_drafter_config(drafter_dir)["kind"]
    if cfg.drafter.online.enabled and cfg.rollout.spec.uses_drafter:
        from fastdraft.trainer.online_drafter import online_loss
        online_loss(cfg.drafter.online.loss, kind)


def devices_here(cfg: RunConfig) -> bool:
    """Whether this machine is the one the recipe's devices are checked on: always for a CPU
    recipe; for a CUDA one where this torch sees a GPU (a dry run elsewhere plans a node)."""
    return torch.device(cfg.model.device).type != "cuda" or torch.cuda.is_available()


def check_ranks(cfg: RunConfig) -> None:
    """actor.num_ranks against the devices of this node (the actor's ranks rendezvous on it):
    one GPU a rank, or on a CPU one core a rank, before any rank is spawned."""
    ranks = cfg.actor.num_ranks
    if torch.device(cfg.model.device).type == "cuda":
        have, what = torch.cuda.device_count(), "CUDA device(s) (one a rank)"
    else:
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")   # Linux
                 else os.cpu_count() or 1)
        have, what = cores, "CPU core(s) (a rank is a process of its own)"
    if ranks > have:
        raise FastdraftError(f"actor.num_ranks={ranks}, but this machine has {have} {what}: "
                             f"set actor.num_ranks to at most {have}")


def check_backend(cfg: RunConfig) -> None:
    """rollout.backend=vllm needs vLLM importable in this Python, told before any work (a
    drafter warm-up takes minutes)."""
    if cfg.rollout.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise FastdraftError(
            "rollout.backend=vllm, but vLLM is not installed in this Python environment: set "
            "one up with `bash scripts/setup-vllm.sh` and run `.venv-vllm/bin/fastdraft run ...`"
            " (README: vLLM as the rollout backend), or set rollout.backend=native")


def cached_policy(cfg: RunConfig, cache_dir: Path | None) -> Path:
    """model.path, or the bootstrap policy already in the cache (a dry run trains nothing)."""
    if cfg.model.path is not None:
        return Path(cfg.model.path).expanduser()
    from fastdraft.bootstrap.run import bootstrap_dir, default_cache_dir, load_cached
    from fastdraft.bootstrap.spec import get_spec
    cached = load_cached(bootstrap_dir(cache_dir or default_cache_dir(),
                                       get_spec(cfg.model.bootstrap), seed=0))
    if cached is None:
        raise FastdraftError(f"--dry-run plans from the policy's config.json: set model.path, "
                             f"or bootstrap the policy first (`fastdraft bootstrap --spec "
                             f"{cfg.model.bootstrap}`)")
    return Path(cached.policy_dir)
