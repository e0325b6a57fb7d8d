"""The sections of a run, one frozen dataclass each, checked at construction. A YAML recipe maps
onto them 1:1 (config/recipe.py): `actor.lr` in a recipe is `RunConfig.actor.lr` here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastdraft.engine.spec.budget import BudgetConfig
from fastdraft.engine.spec.config import SpecConfig
from fastdraft.engine.spec.tuner import TunerConfig

DTYPES = ("float32", "bfloat16", "float16")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyConfig:
    """The policy. path: an HF checkpoint directory; None = the bootstrap policy (trained once
    and cached: the tiny CPU recipe)."""

    path: str | None = None
    device: str = "cpu"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")


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
class AlgorithmConfig:
    """advantage / loss: registered names (fastdraft/rl/advantages.py, policy_loss.py); their
    options: scale_std (GRPO; false = Dr. GRPO), clip_eps, clip_high (DAPO), kl_coef (k3 KL to
    the frozen initial policy), aggregation (token-mean | seq-mean-token-mean |
    seq-mean-token-sum-norm); skip_zero_variance drops groups whose rewards are all equal
    (DAPO). logprob_tolerance: the lossless gate (actor vs engine logprobs, per token)."""

    num_steps: int = 20
    advantage: str = "grpo"
    scale_std: bool = True
    loss: str = "grpo"
    clip_eps: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    aggregation: str | None = None      # None: the loss's own default
    skip_zero_variance: bool = False
    logprob_tolerance: float | None = None  # None: from the dtype (fp32 1e-3, bf16 5e-2)

    def __post_init__(self) -> None:
        _require(self.num_steps >= 1, "algorithm.num_steps must be >= 1")
        _require(self.kl_coef >= 0 and self.clip_eps > 0, "algorithm.kl_coef must be >= 0 "
                 "and clip_eps > 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class ActorConfig:
    """The trained policy: fp32 master weights and AdamW state, sharded with FSDP2 over
    num_ranks processes (rank 0 is the run's own process; gloo on CPU, nccl on GPU: rank r on
    cuda:r). compute_dtype: the dtype of its forward and backward (float32 | bfloat16 |
    float16; float16 with a dynamic loss scale); the engine serves model.dtype, cast from the
    masters at every push. micro_batch_tokens bounds the tokens of one forward/backward
    (gradients accumulate over micro-batches into one optimizer step per update, whatever the
    budget or the number of ranks); updates_per_step optimizer steps per rollout, the LR
    schedule counting optimizer steps."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    grad_clip: float = 1.0
    updates_per_step: int = 1
    micro_batch_tokens: int = 8192
    compute_dtype: str = "float32"
    num_ranks: int = 1

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

    loss: eagle1 | eagle3 | reward_kd (trainer/losses.py); lr; token_budget: tokens per packed
    micro-batch; buffer_mb: the DataBuffer's capacity; offset_mix: share of each micro-batch
    given to the previous step's longest samples; tail_fraction: the trainer starts once fewer
    than this share of the rollout's requests still run; during_update: it also trains while
    the actor updates; max_steps_per_step: micro-steps per RL step at most (0: no cap);
    num_threads: torch intra-op threads of the trainer's process;
    refresh: every_step (publish after each step) or on_drop (only once the measured accept
    length fell by refresh_drop below the last published drafter's first step)."""

    enabled: bool = False
    loss: str = "eagle1"
    lr: float = 3e-4
    token_budget: int = 2048
    buffer_mb: float = 256.0
    offset_mix: float = 0.5
    tail_fraction: float = 0.5
    during_update: bool = True
    max_steps_per_step: int = 0
    num_threads: int = 1
    refresh: str = "every_step"
    refresh_drop: float = 0.3

    def __post_init__(self) -> None:
        _require(self.refresh in ("every_step", "on_drop"),
                 f"drafter.online.refresh must be every_step or on_drop, got {self.refresh!r}")
        _require(0 < self.tail_fraction <= 1, "drafter.online.tail_fraction must be in (0, 1]")
        _require(self.buffer_mb > 0 and self.lr > 0 and self.token_budget >= 2,
                 "drafter.online: buffer_mb and lr must be > 0, token_budget >= 2")
        _require(self.num_threads >= 1 and self.max_steps_per_step >= 0,
                 "drafter.online: num_threads must be >= 1, max_steps_per_step >= 0")


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
