"""The sections of a run, one frozen dataclass each, checked at construction. A YAML recipe maps
onto them 1:1 (config/recipe.py): `actor.lr` in a recipe is `RunConfig.actor.lr` here."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from fastdraft.bootstrap.spec import BOOTSTRAP_SPECS
from fastdraft.engine.spec.budget import BudgetConfig
from fastdraft.engine.spec.config import SpecConfig
from fastdraft.engine.spec.tuner import TunerConfig
from fastdraft.rl.advantages import (
    advantage_aggregation,
    advantage_defaults,
    available_advantages,
)
from fastdraft.rl.policy_loss import (
    available_aggregations,
    available_policy_losses,
    policy_loss_defaults,
)

DTYPES = ("float32", "bfloat16", "float16")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyConfig:
    """The policy. path: an HF checkpoint directory; None = the bootstrap policy named by
    bootstrap (fastdraft/bootstrap/spec.py: tiny = the Qwen2 of the tiny CPU recipe, tiny-qwen3
    = a Qwen3 with head_dim 64), trained once and cached."""

    path: str | None = None
    bootstrap: str = "tiny"
    device: str = "cpu"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.bootstrap in BOOTSTRAP_SPECS, f"model.bootstrap must be one of "
                 f"{BOOTSTRAP_SPECS.names()} (a bootstrap policy's spec), got {self.bootstrap!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """Prompts and their reward. task: problems drawn from a registered task (its verifier is
    the reward): fresh ones every step, or task_pool of them drawn once and visited epoch by
    epoch like a dataset; or path: a local parquet / JSONL file with prompt and answer columns,
    scored by the registered `reward`."""

    task: str | None = "modsum"
    task_options: dict[str, Any] = field(default_factory=dict)  # the task's own settings
    task_pool: int | None = None        # a dataset of this many task problems, visited in epochs
    path: str | None = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    reward: str = "math"
    add_special_tokens: bool | None = None  # None: no for task prompts, yes for file prompts
    seed: int = 0

    def __post_init__(self) -> None:
        _require((self.task is None) != (self.path is None),
                 "data: set exactly one of data.task (a built-in task) and data.path (a local "
                 "parquet / JSONL file)")


@dataclass(frozen=True, kw_only=True, slots=True)
class TunerSection:
    """rollout.tuner: the speculation config picked per engine step by the BEG-MAB tuner
    (engine/spec/tuner.py). buckets: {min_batch: [arm, ...]}, an arm 'off' or
    'method/depth/topk/tokens_to_verify', the prior's favourite first; empty: default arms
    around rollout.spec (its tree the largest), "off" first from elastic_threshold requests."""

    enabled: bool = False
    buckets: dict[int, list[str]] = field(default_factory=dict)
    epsilon: float = 0.1
    window: int = 300
    max_age: int = 3000
    min_records: int = 2
    elastic_threshold: int = 32

    def __post_init__(self) -> None:
        _require(self.elastic_threshold >= 2, "rollout.tuner.elastic_threshold must be >= 2")
        if self.buckets:   # malformed arms fail when the recipe loads, not mid-run
            self.build(SpecConfig(method="eagle"), seed=0)

    def build(self, spec: SpecConfig, seed: int, max_batch: int = 256) -> TunerConfig:
        knobs = dict(epsilon=self.epsilon, window=self.window, max_age=self.max_age,
                     min_records=self.min_records, seed=seed)
        try:
            if self.buckets:
                return TunerConfig.from_names(self.buckets, **knobs)
            return TunerConfig.default(spec, self.elastic_threshold, max_batch, **knobs)
        except ValueError as err:
            raise ValueError(f"rollout.tuner: {err}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class BudgetSection:
    """rollout.budget: length-aware speculation budgets (engine/spec/budget.py, DAS): requests
    predicted to finish within the batch's remaining steps decode plainly beside the trees of
    the long ones, in the same forward. window: RL steps of per-prompt length history; margin:
    lower speculates on more requests."""

    enabled: bool = False
    window: int = 4
    margin: float = 1.0

    def __post_init__(self) -> None:
        self.build()   # malformed values fail when the recipe loads

    def build(self) -> BudgetConfig:
        try:
            return BudgetConfig(window=self.window, margin=self.margin)
        except ValueError as err:
            raise ValueError(f"rollout.budget: {err}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    """prompts_per_step prompts, group_size samples each (GRPO's n), served by the engine."""

    prompts_per_step: int = 16
    group_size: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    max_batch_size: int = 64
    max_seq_len: int | None = None      # None: the longest prompt + max_new_tokens
    spec: SpecConfig = field(default_factory=lambda: SpecConfig(method="eagle", depth=6, topk=3,
                                                                tokens_to_verify=12))
    tuner: TunerSection = field(default_factory=TunerSection)
    budget: BudgetSection = field(default_factory=BudgetSection)
    graphs: bool | None = None          # None: CUDA graphs on CUDA devices
    compile: bool = False

    def __post_init__(self) -> None:
        _require(not self.tuner.enabled or self.spec.enabled, "rollout.tuner.enabled needs a "
                 "speculative rollout.spec.method (e.g. eagle): the tuner picks among its trees")
        _require(not self.budget.enabled or self.spec.enabled, "rollout.budget.enabled needs a "
                 "speculative rollout.spec.method (e.g. eagle): budgets say which rows draft")
        for name in ("prompts_per_step", "group_size", "max_new_tokens", "max_batch_size"):
            _require(getattr(self, name) >= 1, f"rollout.{name} must be >= 1")
        _require(self.temperature > 0, "rollout.temperature must be > 0: RL samples (greedy "
                 "rollouts give every group one answer)")
        _require(0 < self.top_p <= 1, "rollout.top_p must be in (0, 1]")


@dataclass(frozen=True, kw_only=True, slots=True)
class GateSection:
    """algorithm.gate: the lossless gate (rl/gate.py), checked every step before any weight
    moves. Limits on |actor - engine| logprob per sampled token: mean_tolerance (their mean),
    quantile_tolerance (their `quantile`, e.g. the 0.99 one), max_tolerance (fail-fast, one
    gross token); None: from the coarser of model.dtype and actor.compute_dtype (rl/gate.py
    DTYPE_TOLERANCE). law_z_threshold: |z| of the law statistic beyond which the rollout counts
    as not sampled from the policy (6: a false alarm ~2e-9 a step; None: no law check), judged
    from law_min_tokens sampled tokens on."""

    mean_tolerance: float | None = None
    quantile: float = 0.99
    quantile_tolerance: float | None = None
    max_tolerance: float | None = None
    law_z_threshold: float | None = 6.0
    law_min_tokens: int = 128

    def __post_init__(self) -> None:
        for name in ("mean_tolerance", "quantile_tolerance", "max_tolerance", "law_z_threshold"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"algorithm.gate.{name} must be > 0 or null "
                     f"(null: {'no law check' if name == 'law_z_threshold' else 'from the dtypes'})"
                     f", got {value}")
        _require(0.5 <= self.quantile < 1, f"algorithm.gate.quantile must be in [0.5, 1) (a "
                 f"high quantile, e.g. 0.99; the max has its own limit), got {self.quantile}")
        _require(self.law_min_tokens >= 1, "algorithm.gate.law_min_tokens must be >= 1")


# What the registered estimators and losses take (their functions' keyword options): a value
# set for one that does not take it would do nothing, so it is an error.
_REGISTRIES = {"advantage": (available_advantages, advantage_defaults),
               "loss": (available_policy_losses, policy_loss_defaults)}
_OPTION_OWNERS = {"scale_std": "advantage", "clip_high": "loss"}   # field -> its registry


@dataclass(frozen=True, kw_only=True, slots=True)
class AlgorithmConfig:
    """advantage / loss: registered names (fastdraft/rl/advantages.py: grpo, dr_grpo, rloo;
    policy_loss.py: grpo, dapo). Options, each an error where it would do nothing:
    scale_std (advantage grpo only; None: true): divide by the group's std. false removes only
    the division; Dr. GRPO is `advantage: dr_grpo`, which also sets the length-unbiased
    aggregation (seq-mean-token-sum-norm over rollout.max_new_tokens).
    clip_eps: the clip range (grpo: symmetric; dapo: the lower one). clip_high (loss dapo only;
    None: 0.28): DAPO's upper clip. kl_coef: k3 KL to the frozen initial policy.
    aggregation (token-mean | seq-mean-token-mean | seq-mean-token-sum-norm; None: the
    advantage's preset, else the loss's own default). skip_zero_variance drops groups whose
    rewards are all equal (DAPO). gate: the lossless gate's limits (GateSection)."""

    num_steps: int = 20
    advantage: str = "grpo"
    scale_std: bool | None = None       # None: the estimator's default
    loss: str = "grpo"
    clip_eps: float = 0.2
    clip_high: float | None = None      # None: the loss's default
    kl_coef: float = 0.0
    aggregation: str | None = None      # None: the advantage's preset or the loss's default
    skip_zero_variance: bool = False
    gate: GateSection = field(default_factory=GateSection)

    def __post_init__(self) -> None:
        _require(self.num_steps >= 1, "algorithm.num_steps must be >= 1")
        _require(self.kl_coef >= 0 and 0 < self.clip_eps < 1, "algorithm.kl_coef must be >= 0 "
                 "and clip_eps in (0, 1)")
        _require(self.clip_high is None or self.clip_high >= 0,
                 "algorithm.clip_high must be >= 0")
        taken = {kind: _options(kind, getattr(self, kind)) for kind in _REGISTRIES}
        for name, kind in _OPTION_OWNERS.items():
            if getattr(self, name) is not None and name not in taken[kind]:
                names, defaults = _REGISTRIES[kind]
                takers = [n for n in names() if name in defaults(n)]
                raise ValueError(
                    f"algorithm.{name} does nothing with algorithm.{kind}: {getattr(self, kind)} "
                    f"(only {kind} {' / '.join(takers) or '(none)'} takes it): delete it, or "
                    f"choose such a {kind}"
                    + ("; Dr. GRPO is advantage: dr_grpo" if name == "scale_std" else ""))
        _require(self.aggregation is None or self.aggregation in available_aggregations(),
                 f"algorithm.aggregation must be one of {available_aggregations()} or null, "
                 f"got {self.aggregation!r}")
        preset = advantage_aggregation(self.advantage)
        _require(preset is None or self.aggregation in (None, preset),
                 f"algorithm.advantage: {self.advantage} is defined with aggregation {preset}; "
                 f"algorithm.aggregation: {self.aggregation} contradicts it: delete "
                 "algorithm.aggregation, or choose another advantage")


def _options(kind: str, name: str) -> dict[str, Any]:
    """The keyword options (with defaults) of the registered `kind` called `name`."""
    try:
        return _REGISTRIES[kind][1](name)
    except ValueError as err:
        raise ValueError(f"algorithm.{kind}: {err}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class ActorConfig:
    """The trained policy: fp32 master weights and AdamW state, sharded with FSDP2 over
    num_ranks processes (rank 0 is the run's own process; gloo on CPU, nccl on GPU: rank r on
    cuda:r). compute_dtype: the dtype of its forward and backward (float32 | bfloat16 |
    float16; float16 with a dynamic loss scale); the engine serves model.dtype, cast from the
    masters at every push. micro_batch_tokens bounds the tokens of one forward/backward
    (gradients accumulate over micro-batches into one optimizer step per update, whatever the
    budget or the number of ranks); updates_per_step optimizer steps per rollout, the LR
    schedule counting optimizer steps. activation_checkpointing: keep only each decoder
    layer's input for the backward and recompute the rest there (about a third more compute
    for the update; the activations of a micro-batch shrink ~20x at a 7B shape)."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    grad_clip: float = 1.0
    updates_per_step: int = 1
    micro_batch_tokens: int = 8192
    compute_dtype: str = "float32"
    num_ranks: int = 1
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        _require(self.lr > 0, "actor.lr must be > 0")
        _require(self.updates_per_step >= 1 and self.micro_batch_tokens >= 1,
                 "actor.updates_per_step and actor.micro_batch_tokens must be >= 1")
        _require(self.compute_dtype in DTYPES, f"actor.compute_dtype must be one of {DTYPES}, "
                 f"got {self.compute_dtype!r}")
        _require(self.num_ranks >= 1, "actor.num_ranks must be >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class OnlineDrafterConfig:
    """Online drafter training (fastdraft/trainer/) during the run.

    loss: eagle1 | eagle3 | reward_kd (trainer/losses.py); None (the default): the drafter
    kind's own loss (eagle1 for an EAGLE-1 drafter, eagle3 for EAGLE-3); reward_kd trains both
    kinds. lr; token_budget: tokens per packed micro-batch; buffer_mb: the DataBuffer's
    capacity; offset_mix: share of each micro-batch given to the previous step's longest
    samples; tail_fraction: the trainer starts once fewer than this share of the rollout's
    requests still run; during_update: it also trains while the actor updates;
    max_steps_per_step: micro-steps per RL step at most (0: no cap); min_steps_per_step: at
    least this many, topped up at the step boundary (the loop waits for them) when the idle
    time did not suffice, so every step publishes a trained drafter (0: idle time only);
    num_threads: torch
    intra-op threads of the trainer's process; refresh: every_step (publish after each step)
    or on_drop (only once the measured accept length fell by refresh_drop below the last
    published drafter's first step).

    Where and within what it trains:
    device: the trainer process's device (cpu, cuda, cuda:N); None: the policy's model.device,
    so on a GPU node the drafter trains on the GPU (its own process and CUDA context).
    max_sample_tokens: a finished rollout longer than this is cut into windows of at most this
    many tokens (contiguous positions, each a DataBuffer sample of its own) instead of being
    refused or trained on its first tokens only; None: token_budget (at most token_budget).
    inflight_mb: hidden states of still-running requests held at most (MiB); positions beyond
    it are not captured (counted in drafter/dropped_tokens).
    inbox_samples: samples queued for the trainer process at most; one more is dropped
    (counted in drafter/inbox_dropped), so a slow trainer never grows the queue.

    When the trainer fails (none of it stops the run):
    reply_timeout_s: the longest wait for the trainer process; past it the worker counts as
    hung, like a dead one. max_restarts: times a dead, hung or diverged (non-finite) worker is
    restarted from the last good drafter and its last trainer state (0: never; the run goes on
    with the last good drafter, capturing and training nothing). reprobe_every: after a health
    fallback to plain decoding, the newest trained drafter is tried again every this many steps
    (0: the fallback is final, and nothing is captured or trained from then on)."""

    enabled: bool = False
    loss: str | None = None
    lr: float = 3e-4
    token_budget: int = 2048
    buffer_mb: float = 256.0
    offset_mix: float = 0.5
    tail_fraction: float = 0.5
    during_update: bool = True
    max_steps_per_step: int = 0
    min_steps_per_step: int = 0
    num_threads: int = 1
    refresh: str = "every_step"
    refresh_drop: float = 0.3
    device: str | None = None
    max_sample_tokens: int | None = None
    inflight_mb: float = 4096.0
    inbox_samples: int = 256
    reply_timeout_s: float = 120.0
    max_restarts: int = 2
    reprobe_every: int = 10

    def __post_init__(self) -> None:
        _require(self.refresh in ("every_step", "on_drop"),
                 f"drafter.online.refresh must be every_step or on_drop, got {self.refresh!r}")
        _require(0 < self.tail_fraction <= 1, "drafter.online.tail_fraction must be in (0, 1]")
        _require(self.buffer_mb > 0 and self.lr > 0 and self.token_budget >= 2,
                 "drafter.online: buffer_mb and lr must be > 0, token_budget >= 2")
        _require(self.num_threads >= 1 and self.max_steps_per_step >= 0
                 and self.min_steps_per_step >= 0,
                 "drafter.online: num_threads must be >= 1, max_steps_per_step and "
                 "min_steps_per_step >= 0")
        _require(not self.max_steps_per_step or self.min_steps_per_step <= self.max_steps_per_step,
                 "drafter.online.min_steps_per_step must be <= max_steps_per_step")
        _require(self.loss is None or self.loss in ("eagle1", "eagle3", "reward_kd"),
                 f"drafter.online.loss must be eagle1, eagle3, reward_kd or null (the drafter "
                 f"kind's own loss), got {self.loss!r}")
        _require(self.device is None or re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None,
                 f"drafter.online.device must be cpu, cuda, cuda:N or null (the policy's "
                 f"model.device), got {self.device!r}")
        _require(self.max_sample_tokens is None
                 or 2 <= self.max_sample_tokens <= self.token_budget,
                 f"drafter.online.max_sample_tokens must be in [2, token_budget="
                 f"{self.token_budget}] (a longer window would be cut to token_budget anyway) or "
                 f"null, got {self.max_sample_tokens}")
        _require(self.inflight_mb > 0 and self.inbox_samples >= 1,
                 "drafter.online: inflight_mb must be > 0 and inbox_samples >= 1")
        _require(self.reply_timeout_s > 0 and self.max_restarts >= 0 and self.reprobe_every >= 0,
                 "drafter.online: reply_timeout_s must be > 0, max_restarts and reprobe_every "
                 ">= 0")

    @property
    def window_tokens(self) -> int:
        """The longest DataBuffer sample (max_sample_tokens, or token_budget)."""
        return self.max_sample_tokens or self.token_budget


@dataclass(frozen=True, kw_only=True, slots=True)
class DrafterConfig:
    """path: a drafter directory (`fastdraft drafter warmup`); None with the bootstrap policy
    warms one up (cached) with warmup_steps steps on warmup_rollouts rollouts. online: train it
    during the run."""

    path: str | None = None
    kind: str = "eagle1"
    warmup_steps: int = 4000
    warmup_rollouts: int = 2048
    export: bool = True                 # at the end of a run: RUN_DIR/drafter + RUN_DIR/export
    online: OnlineDrafterConfig = field(default_factory=OnlineDrafterConfig)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    every: int = 10
    keep: int = 2

    def __post_init__(self) -> None:
        _require(self.every >= 1 and self.keep >= 1, "checkpoint.every and keep must be >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class WandbConfig:
    mode: str = "offline"       # offline | online | disabled
    project: str = "fastdraft"

    def __post_init__(self) -> None:
        _require(self.mode in ("offline", "online", "disabled"),
                 "logging.wandb.mode must be offline, online or disabled")


@dataclass(frozen=True, kw_only=True, slots=True)
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress: bool = True
    dashboard: bool = True


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    name: str = "run"
    seed: int = 0
    model: PolicyConfig = field(default_factory=PolicyConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
