"""The `rollout` section: the engine's batch, sampling and speculation (tree, tuner, budgets)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastdraft.config.engine import KV_BLOCK_SIZE, BudgetConfig, SpecConfig, TunerConfig
from fastdraft.config.sections.common import require as _require
from fastdraft.errors import FastdraftError


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
        _require(isinstance(self.buckets, dict), "rollout.tuner.buckets must map a batch size to "
                 f"its arms, e.g. {{1: [eagle/6/4/16, off]}}, got {self.buckets!r}")
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
            raise FastdraftError(f"rollout.tuner: {err}") from None


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
            raise FastdraftError(f"rollout.budget: {err}") from None


#: What serves the rollouts (fastdraft/backends): fastdraft's engine, or vLLM (installed apart).
ROLLOUT_BACKENDS = ("native", "vllm")


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
    kv_block_size: int = KV_BLOCK_SIZE  # cells per block of the paged KV cache; 0: static slots
    kv_cache_gb: float | None = None    # the paged cache's size; None: what static slots hold
    # No prefill forward computes more tokens: a longer prompt, or the re-prefill of a
    # preempted request's prompt + answer, runs a chunk a step between decode steps (0: one
    # forward per prefill batch, however long). The native engine's; vLLM chunks by its own.
    prefill_chunk_tokens: int = 8192
    # How paged decode and verify steps attend: "gather" (the rows' blocks copied, then SDPA;
    # the default until a GPU RL run has held the gate with the kernel) or "triton" (kernels/
    # triton_paged_attention.py reads the blocks in place; needs triton, kv_block_size a power
    # of two).
    paged_attention: str = "gather"
    backend: str = "native"             # native: fastdraft's engine; vllm: vLLM (an extra)
    # k > 1: an engine replica spans k devices, each holding 1/k of every layer: native, k
    # hybrid workers (models/tensor_parallel.py; k must divide the policy's KV heads); vllm,
    # vLLM's tensor_parallel_size.
    tensor_parallel: int = 1

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
        _require(self.backend in ROLLOUT_BACKENDS, f"rollout.backend must be one of "
                 f"{', '.join(ROLLOUT_BACKENDS)}, got {self.backend!r}")
        _require(self.kv_block_size >= 0, "rollout.kv_block_size must be >= 0 (0: static "
                 "KV slots, each sized for the longest sequence)")
        _require(self.kv_cache_gb is None or self.kv_cache_gb > 0,
                 "rollout.kv_cache_gb must be > 0 (or null: as much as static slots hold)")
        _require(self.kv_cache_gb is None or self.kv_block_size > 0, "rollout.kv_cache_gb "
                 "sizes the paged KV cache: it needs rollout.kv_block_size > 0")
        _require(self.prefill_chunk_tokens >= 0, "rollout.prefill_chunk_tokens must be >= 0 "
                 "(0: a prefill in one forward)")
        _require(self.paged_attention in ("gather", "triton"), "rollout.paged_attention must "
                 f"be gather or triton, got {self.paged_attention!r}")
        _require(self.paged_attention == "gather" or self.kv_block_size > 0, "rollout."
                 "paged_attention: triton reads a paged KV cache: set rollout.kv_block_size > 0")
        _require(self.paged_attention == "gather" or self.backend == "native", "rollout."
                 "paged_attention is the native engine's: vLLM picks its own attention")
        _require(self.tensor_parallel >= 1, "rollout.tensor_parallel must be >= 1 (1: a "
                 "replica a device)")
        _require(self.tensor_parallel == 1 or not self.tuner.enabled, "rollout.tuner picks "
                 "trees by measured time, which the ranks of a tensor-parallel replica would "
                 "each measure alike only by chance: disable it with rollout.tensor_parallel > 1")


