"""The `rollout` section: the engine's batch, sampling and speculation (tree, tuner, budgets)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar

from fastdraft.config.engine import (
    KV_BLOCK_SIZE,
    MERGED,
    BudgetConfig,
    SpecConfig,
    TunerConfig,
    tree_capacity,
)
from fastdraft.config.sections.common import Range, check_ranges
from fastdraft.config.sections.common import require as _require
from fastdraft.errors import FastdraftError


@dataclass(frozen=True, kw_only=True, slots=True)
class TunerSection:
    """rollout.tuner: the speculation config picked per engine step by the BEG-MAB tuner
    (engine/spec/tuner.py). buckets: {min_batch: [arm, ...]}, an arm 'off' or
    'method/depth/topk/tokens_to_verify', the prior's favourite first; empty: default arms
    around rollout.spec (its tree the largest), "off" first from elastic_threshold requests."""

    SECTION: ClassVar[str] = "rollout.tuner"

    enabled: bool = False
    buckets: dict[int, list[str]] = field(default_factory=dict)
    epsilon: Annotated[float, Range(ge=0, le=1, note="the exploration rate")] = 0.1
    window: Annotated[int, Range(ge=1)] = 300
    max_age: Annotated[int, Range(ge=1)] = 3000
    min_records: Annotated[int, Range(ge=0)] = 2
    elastic_threshold: Annotated[int, Range(ge=2)] = 32

    def __post_init__(self) -> None:
        check_ranges(self)
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

    SECTION: ClassVar[str] = "rollout.budget"

    enabled: bool = False
    window: Annotated[int, Range(ge=1, note="RL steps")] = 4
    margin: Annotated[float, Range(gt=0)] = 1.0

    def __post_init__(self) -> None:
        check_ranges(self)
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

    SECTION: ClassVar[str] = "rollout"

    prompts_per_step: Annotated[int, Range(ge=1)] = 16
    group_size: Annotated[int, Range(ge=1)] = 4
    temperature: Annotated[float, Range(gt=0, note="RL samples: greedy rollouts give every "
                                        "group one answer")] = 1.0
    top_p: Annotated[float, Range(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Range(ge=1, allow={-1}, note="-1: off")] = -1
    max_new_tokens: Annotated[int, Range(ge=1)] = 128
    max_batch_size: Annotated[int, Range(ge=1)] = 64
    # None: the longest prompt + max_new_tokens
    max_seq_len: Annotated[int | None, Range(ge=2, note="the longest prompt + "
                                             "max_new_tokens")] = None
    spec: SpecConfig = field(default_factory=lambda: SpecConfig(method="eagle", depth=6, topk=3,
                                                                tokens_to_verify=12))
    tuner: TunerSection = field(default_factory=TunerSection)
    budget: BudgetSection = field(default_factory=BudgetSection)
    graphs: bool | None = None          # None: CUDA graphs on CUDA devices
    compile: bool = False
    # cells per block of the paged KV cache; 0: static slots
    kv_block_size: Annotated[int, Range(ge=0, note="0: static KV slots, each sized for the "
                                        "longest sequence")] = KV_BLOCK_SIZE
    # the paged cache's size; None: what static slots hold
    kv_cache_gb: Annotated[float | None, Range(gt=0, note="as much as static slots hold")] = None
    # No prefill forward computes more tokens: a longer prompt, or the re-prefill of a
    # preempted request's prompt + answer, runs a chunk a step between decode steps (0: one
    # forward per prefill batch, however long). The native engine's; vLLM chunks by its own.
    prefill_chunk_tokens: Annotated[int, Range(ge=0, note="0: a prefill in one forward")] = 8192
    # How paged decode and verify steps attend: "gather" (the rows' blocks copied, then SDPA;
    # the default until a GPU RL run has held the gate with the kernel) or "triton" (kernels/
    # triton_paged_attention.py reads the blocks in place; needs triton, kv_block_size a power
    # of two).
    paged_attention: str = "gather"
    backend: str = "native"             # native: fastdraft's engine; vllm: vLLM (an extra)
    # k > 1: an engine replica spans k devices, each holding 1/k of every layer: native, k
    # hybrid workers (models/tensor_parallel.py; k must divide the policy's KV heads); vllm,
    # vLLM's tensor_parallel_size.
    tensor_parallel: Annotated[int, Range(ge=1, note="1: a replica a device")] = 1

    def __post_init__(self) -> None:
        check_ranges(self)
        _require(self.max_seq_len is None or self.max_seq_len > self.max_new_tokens,
                 f"rollout.max_seq_len={self.max_seq_len} must be > rollout.max_new_tokens="
                 f"{self.max_new_tokens}: a sequence holds its prompt and the answer budget "
                 "(raise max_seq_len, lower max_new_tokens, or set max_seq_len=null: the longest "
                 "prompt + max_new_tokens)")
        self._check_tree()
        _require(not self.tuner.enabled or self.spec.enabled, "rollout.tuner.enabled needs a "
                 "speculative rollout.spec.method (e.g. eagle): the tuner picks among its trees")
        _require(not self.budget.enabled or self.spec.enabled, "rollout.budget.enabled needs a "
                 "speculative rollout.spec.method (e.g. eagle): budgets say which rows draft")
        _require(self.backend in ROLLOUT_BACKENDS, f"rollout.backend must be one of "
                 f"{', '.join(ROLLOUT_BACKENDS)}, got {self.backend!r}")
        _require(self.kv_cache_gb is None or self.kv_block_size > 0, "rollout.kv_cache_gb "
                 "sizes the paged KV cache: it needs rollout.kv_block_size > 0")
        _require(self.paged_attention in ("gather", "triton"), "rollout.paged_attention must "
                 f"be gather or triton, got {self.paged_attention!r}")
        _require(self.paged_attention == "gather" or self.kv_block_size > 0, "rollout."
                 "paged_attention: triton reads a paged KV cache: set rollout.kv_block_size > 0")
        _require(self.paged_attention == "gather" or self.backend == "native", "rollout."
                 "paged_attention is the native engine's: vLLM picks its own attention")
        _require(self.tensor_parallel == 1 or not self.tuner.enabled, "rollout.tuner picks "
                 "trees by measured time, which the ranks of a tensor-parallel replica would "
                 "each measure alike only by chance: disable it with rollout.tensor_parallel > 1")

    def _check_tree(self) -> None:
        """An EAGLE tree of rollout.spec's shape holds tree_capacity(depth, topk) nodes (the
        root's topk children, then topk x topk candidates a level; a merged tree adds a suffix
        chain of up to depth nodes): verifying more than it holds would only be cut back."""
        spec = self.spec
        if not spec.uses_drafter:
            return
        merged = spec.method == MERGED
        most = tree_capacity(spec.depth, spec.topk) + (spec.depth if merged else 0)
        how = "topk + (depth - 1) x topk**2" + (" + depth suffix nodes" if merged else "")
        _require(spec.tokens_to_verify <= most,
                 f"rollout.spec.tokens_to_verify={spec.tokens_to_verify} is more nodes than a "
                 f"tree of rollout.spec.depth={spec.depth} and topk={spec.topk} holds ({most}: "
                 f"{how}): lower it to {most} at most, or raise depth or topk")
