"""A GRPO run assembled from its config: the policy (the bootstrap one when none is given) and its
drafter, the rollout engine, the actor, the algorithm, the prompts, the metrics, the
checkpoints; resumed from the newest complete checkpoint when asked. rl/loop.py drives it."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fastdraft.checkpoint import CheckpointManager, TrainState
from fastdraft.config import RunConfig, dump_config
from fastdraft.config.recipe import config_dict
from fastdraft.drafter import save_drafter
from fastdraft.drafter.checkpoint import trainable_named_tensors
from fastdraft.engine import Completion, RolloutEngine
from fastdraft.models import load_model
from fastdraft.rl.actor import Actor
from fastdraft.rl.dashboard import draw_dashboard
from fastdraft.rl.gate import DEFAULT_TOLERANCE
from fastdraft.rl.metrics import MetricsLogger
from fastdraft.rl.objective import Algorithm
from fastdraft.rl.online_drafter import FixedDrafter, OnlineDrafter
from fastdraft.rl.prompts import PromptSource

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Run:
    def __init__(self, cfg: RunConfig, run_dir: Path, resume: bool = False,
                 cache_dir: Path | None = None) -> None:
        check_paths(cfg)
        self.cfg, self.run_dir = cfg, run_dir
        self.checkpoints = CheckpointManager(run_dir, keep=cfg.checkpoint.keep)
        latest = self.checkpoints.latest() if resume else None
        if resume and latest is None:
            raise ValueError(f"--resume: no complete checkpoint in {run_dir / 'checkpoints'}; "
                             "start a new run without --resume")
        if not resume and (run_dir / "checkpoints").is_dir() and self.checkpoints.latest():
            raise ValueError(f"{run_dir} already holds a run: pass --resume to continue it, or "
                             "choose another --run-dir")
        run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, run_dir / "config.yaml")
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.policy_dir = resolve_policy(cfg, cache_dir)
        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(self.policy_dir)
        dtype, device = DTYPES[cfg.model.dtype], cfg.model.device
        max_seq_len = rollout_seq_len(cfg)
        self.prompts = PromptSource(cfg.data, self.tokenizer,
                                    max_seq_len - cfg.rollout.max_new_tokens)
        self.engine = RolloutEngine(
            self.policy_dir, device=device, dtype=dtype, max_batch_size=cfg.rollout.max_batch_size,
            max_seq_len=max_seq_len, drafter=resolve_drafter(cfg, self.policy_dir),
            spec=cfg.rollout.spec, compile=cfg.rollout.compile, graphs=cfg.rollout.graphs,
            tuner=cfg.rollout.tuner.build(cfg.rollout.spec, cfg.seed, cfg.rollout.max_batch_size)
            if cfg.rollout.tuner.enabled else None,
            budget=cfg.rollout.budget.build() if cfg.rollout.budget.enabled else None)
        # The actor scores every position the engine can sample at (its rotary table too).
        self.actor = Actor(load_model(self.policy_dir, device, dtype, max_seq_len), cfg.actor,
                           cfg.algorithm.num_steps)
        self.reference = None
        if cfg.algorithm.kl_coef > 0:  # KL to the frozen initial policy
            self.reference = load_model(self.policy_dir, device, dtype, max_seq_len)
            self.reference.eval().requires_grad_(False)
        self.algorithm = Algorithm(cfg.algorithm, cfg.rollout.temperature,
                                   max_tokens=cfg.rollout.max_new_tokens)
        self.logprob_tolerance = (cfg.algorithm.logprob_tolerance
                                  or DEFAULT_TOLERANCE[dtype])
        self.start_step = 0
        trainer_state = None
        if latest is not None:
            loaded = self.checkpoints.load(latest, self.actor.unwrapped(), self.actor.optimizer)
            self.start_step = self.actor.step = loaded.step
            self.engine.load_weights(self.actor.named_parameters(), version=loaded.step)
            self.engine.rl_step = loaded.step
            if loaded.drafter is not None:   # the drafter the run had trained online
                self.engine.load_drafter_weights(list(loaded.drafter["tensors"].items()),
                                                 version=int(loaded.drafter["version"]))
                trainer_state = loaded.drafter.get("trainer")
            if self.engine.tuner is not None and "tuner" in loaded.extra:
                self.engine.tuner.load_state_dict(loaded.extra["tuner"])
            if self.engine.budget is not None and "budget" in loaded.extra:
                self.engine.budget.load_state_dict(loaded.extra["budget"])
            print(f"resumed from {latest} (step {loaded.step})")
        self.logger = MetricsLogger(run_dir, cfg.logging, config_dict(cfg), cfg.name,
                                    cfg.algorithm.num_steps, self.start_step)
        # Callbacks on every finished rollout (the online drafter trainer listens here).
        self.drafter: OnlineDrafter | FixedDrafter = FixedDrafter()
        if cfg.drafter.online.enabled:
            self.drafter = OnlineDrafter(cfg.drafter.online, self.engine, cfg.seed,
                                         trainer_state)
        self.on_finish_hooks: list[Callable[[Completion], None]] = [self.drafter.on_finish]
        self.last_checkpoint_s = 0.0

    def on_finish(self, completion: Completion) -> None:
        for hook in self.on_finish_hooks:
            hook(completion)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def rollout_metrics(self, completions: list[Completion], rewards: list[float]
                        ) -> dict[str, float]:
        trace, stats = self.engine.last_trace, self.engine.last_stats
        lengths = [len(c.token_ids) for c in completions]
        mean = sum(rewards) / len(rewards)
        out = {"reward/mean": mean,
               "reward/std": (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5,
               "rollout/time_s": trace.time_s, "rollout/tail_time_s": trace.tail_time_s(),
               "rollout/tokens_per_s": sum(lengths) / max(trace.time_s, 1e-9),
               "rollout/response_len_mean": sum(lengths) / len(lengths),
               "rollout/response_len_max": float(max(lengths))}
        if self.engine.spec.enabled:   # not after a health fallback
            out.update(stats.as_metrics())
            out["rollout/sd_fraction"] = trace.sd_fraction
            out["drafter/version"] = float(self.engine.drafter_version or 0)
        return out

    def save_checkpoint(self, step: int) -> None:
        start = time.perf_counter()
        self.checkpoints.save(step, TrainState(
            model=self.actor.unwrapped(), optimizer=self.actor.optimizer.state_dict(),
            step=step, config=config_dict(self.cfg), drafter=self._drafter_state(),
            extra=self._engine_state()))
        self.last_checkpoint_s = time.perf_counter() - start

    def _engine_state(self) -> dict[str, Any]:
        """What the engine learned by measuring (tuner rewards, answer-length history)."""
        parts = {"tuner": self.engine.tuner, "budget": self.engine.budget}
        return {name: part.state_dict() for name, part in parts.items() if part is not None}

    def _drafter_state(self) -> dict[str, Any] | None:
        """The engine's drafter (trainable tensors) and version: what --resume puts back."""
        drafter = self.engine.model_drafter
        if drafter is None or self.engine.drafter_version is None:
            return None
        state = {"tensors": {n: t.detach() for n, t in trainable_named_tensors(drafter)},
                 "version": self.engine.drafter_version}
        trainer = self.drafter.trainer_state()   # the online trainer's optimizer, RNG, ...
        return state if trainer is None else {**state, "trainer": trainer}

    def finish(self) -> None:
        self.drafter.close()
        self.checkpoints.close()
        drafter = self.engine.model_drafter
        if drafter is not None and self.cfg.drafter.export:
            from fastdraft.export import export_drafter
            save_drafter(drafter, self.run_dir / "drafter",
                         extra={"drafter_version": self.engine.drafter_version})
            latest = self.checkpoints.latest()
            try:
                out = export_drafter(self.run_dir / "drafter", latest / "model",
                                     self.run_dir / "export", "all") if latest else []
                print("drafter exported for SGLang / vLLM: " + ", ".join(map(str, out)))
            except ValueError as err:   # a drafter no engine format can hold: say why
                print(f"drafter saved to {self.run_dir / 'drafter'}; not exported: {err}")
        self.logger.close()
        if self.cfg.logging.dashboard:
            print(f"dashboard: {draw_dashboard(self.run_dir)}")


def check_paths(cfg: RunConfig) -> None:
    """Every local path the recipe names, checked before any work: one error lists them all."""
    missing = []
    for key, value, want in (("model.path", cfg.model.path, "config.json"),
                             ("data.path", cfg.data.path, None),
                             ("drafter.path", cfg.drafter.path, None)):
        if value is None:
            continue
        path = Path(value).expanduser()
        if not path.exists() or (want is not None and not (path / want).is_file()):
            missing.append(f"{key}: {path}" + (f" (no {want})" if path.exists() else ""))
    if missing:
        raise FileNotFoundError("the recipe names paths that do not exist: " + "; ".join(
            missing) + " (edit the recipe or override, e.g. model.path=/local/checkpoint)")


def resolve_policy(cfg: RunConfig, cache_dir: Path | None) -> Path:
    """The recipe's checkpoint directory, or the bootstrap policy (trained once, cached)."""
    if cfg.model.path is not None:
        path = Path(cfg.model.path).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path {path}: no config.json there; point it at a "
                                    "local HF checkpoint directory")
        return path
    from fastdraft.bootstrap.run import run_bootstrap
    return run_bootstrap(cache_dir).policy_dir


def resolve_drafter(cfg: RunConfig, policy_dir: Path) -> Path | None:
    """The drafter of an EAGLE recipe: drafter.path, or for the bootstrap policy one warmed up
    with the recipe's settings (cached beside the policy)."""
    if not cfg.rollout.spec.uses_drafter:
        return None
    if cfg.drafter.path is not None:
        path = Path(cfg.drafter.path).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"drafter.path {path} not found: train one with `fastdraft "
                                    f"drafter warmup --policy {policy_dir} --out {path}`")
        return path
    if cfg.model.path is not None:
        raise ValueError("rollout.spec.method=eagle needs drafter.path for a policy of your own: "
                         f"train one with `fastdraft drafter warmup --policy {policy_dir}`, or "
                         "use rollout.spec.method=suffix (no training needed)")
    from fastdraft.demo import ensure_drafter
    from fastdraft.drafter.warmup import WarmupConfig
    warmup = WarmupConfig(kind=cfg.drafter.kind, steps=cfg.drafter.warmup_steps,
                          num_rollouts=cfg.drafter.warmup_rollouts)
    return ensure_drafter(policy_dir, None, warmup=warmup)


def rollout_seq_len(cfg: RunConfig) -> int:
    """rollout.max_seq_len, or the longest prompt a task draws (over many samples) + the
    answer budget."""
    if cfg.rollout.max_seq_len:
        return cfg.rollout.max_seq_len
    from fastdraft.rl.tasks import get_task
    if cfg.data.task is None:
        raise ValueError("rollout.max_seq_len must be set for prompt files")
    task = get_task(cfg.data.task, **cfg.data.task_options)
    longest = getattr(task, "max_prompt_chars", None)
    if longest is None:
        rng = random.Random(0)
        longest = 2 * max(len(task.sample(rng).prompt) for _ in range(4096))
    return longest + cfg.rollout.max_new_tokens + 8


def run_recipe(cfg: RunConfig, run_dir: Path, resume: bool = False,
               cache_dir: Path | None = None) -> Any:
    from fastdraft.rl.loop import train
    run = Run(cfg, run_dir, resume, cache_dir)
    train(run)
    return run
