"""The `drafter` section: the drafter and its online training."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, ClassVar

from fastdraft.config.sections.common import Range, check_ranges
from fastdraft.config.sections.common import require as _require


@dataclass(frozen=True, kw_only=True, slots=True)
class OnlineDrafterConfig:
    """Online drafter training (fastdraft/trainer/) during the run.

    loss: eagle1 | eagle3 | reward_kd (trainer/losses.py); None (the default): the drafter
    kind's own loss (eagle1 for an EAGLE-1 drafter, eagle3 for EAGLE-3); reward_kd trains both
    kinds. lr; lr_warmup_steps: micro-steps over which the learning rate rises linearly to lr
    (a fresh AdamW's first steps move every weight of the warmed-up drafter by ~lr; 0: lr
    from the first); token_budget: tokens per packed micro-batch; buffer_mb: the DataBuffer's
    capacity; offset_mix: share of each micro-batch given to the previous step's longest
    samples; tail_fraction: the trainer starts once fewer than this share of the rollout's
    requests still run; during_update: it also trains while the actor updates;
    max_steps_per_step: micro-steps per RL step at most (0: no cap); min_steps_per_step: at
    least this many, topped up at the step boundary (the loop waits for them) when the idle
    time did not suffice, so every step publishes a trained drafter (0: idle time only);
    num_threads: torch
    intra-op threads of the trainer's process; source: where the (hidden state, next token)
    samples come from: auto (engine where the rollout engine can capture: fastdraft's; actor
    with vLLM), engine (the rollout engine captures them as requests finish, so the
    rollout's own tail trains on them) or actor (the actor's update forward over the rollout
    yields them, actor/samples.py: no capture in the engine, a forward of its own for the
    rows the update leaves out, the tail trains on the previous step's); refresh: every_step
    (publish after each step) or on_drop (only once the measured accept length fell by
    refresh_drop below the last published drafter's first step).
    holdout_every: every this many rollouts of a step are held out of training (0: none, the
    default); at each publish the trained drafter and the serving one are scored on the
    newest step's held-out rollouts (expected accept length, drafter/acceptance.py), and a
    trained drafter that scores lower is withheld: the engine keeps the serving one
    (drafter/withheld), the trainer trains on.

    Where and within what it trains:
    device: the trainer process's device (cpu, cuda, cuda:N); None: the policy's model.device,
    so on a GPU node the drafter trains on the GPU (its own process and CUDA context).
    compute_dtype: the trainer's forward and backward, float32 or bfloat16 (under autocast;
    the masters and AdamW stay fp32 either way); None: bfloat16 where it trains on a GPU,
    float32 on a CPU.
    max_sample_tokens: a finished rollout longer than this is cut into windows of at most this
    many tokens (contiguous positions, each a DataBuffer sample of its own) instead of being
    refused or trained on its first tokens only; None: token_budget (at most token_budget).
    window_context: tokens each window after a rollout's first leads with, attended to but
    not scored, so no pair is trained without the context it has at inference
    (databuffer/windows.py); None: min(128, half a window); at most half a window.
    inflight_mb: hidden states of still-running requests held at most (MiB): whole requests
    are captured, each admitted at its prefill while half of it is free, cut where it
    outgrows the rest; what is not captured is counted in drafter/dropped_tokens
    (trainer/collector.py).
    inbox_samples: samples sent to the trainer and not yet taken by it at most; one more is
    dropped (counted in drafter/inbox_dropped), so a slow trainer never grows the queue.

    When the trainer fails (none of it stops the run):
    reply_timeout_s: the longest wait for the trainer process; past it the worker counts as
    hung, like a dead one. max_restarts: times a dead, hung or diverged (non-finite) worker is
    restarted from the last good drafter and its last trainer state (0: never; the run goes on
    with the last good drafter, capturing and training nothing). reprobe_every: after a health
    fallback to plain decoding, the newest trained drafter is tried again every this many steps
    (0: the fallback is final, and nothing is captured or trained from then on)."""

    SECTION: ClassVar[str] = "drafter.online"

    enabled: bool = False
    loss: str | None = None
    lr: Annotated[float, Range(gt=0)] = 3e-4
    lr_warmup_steps: Annotated[int, Range(ge=0, note="0: lr from the first")] = 0
    token_budget: Annotated[int, Range(ge=2)] = 2048
    buffer_mb: Annotated[float, Range(gt=0)] = 256.0
    offset_mix: Annotated[float, Range(ge=0, le=1, note="a share of each micro-batch")] = 0.5
    tail_fraction: Annotated[float, Range(gt=0, le=1, note="a share of the rollout's "
                                          "requests")] = 0.5
    during_update: bool = True
    max_steps_per_step: Annotated[int, Range(ge=0, note="0: no cap")] = 0
    min_steps_per_step: Annotated[int, Range(ge=0, note="0: idle time only")] = 0
    num_threads: Annotated[int, Range(ge=1)] = 1
    source: str = "auto"
    refresh: str = "every_step"
    refresh_drop: Annotated[float, Range(ge=0, note="accepted tokens")] = 0.3
    holdout_every: Annotated[int, Range(ge=2, allow={0}, note="0: no check; 1 would leave "
                                        "nothing to train on")] = 0
    device: str | None = None
    compute_dtype: str | None = None
    max_sample_tokens: Annotated[int | None, Range(ge=2, note="token_budget")] = None
    window_context: Annotated[int | None, Range(ge=0, note="min(128, half a window)")] = None
    inflight_mb: Annotated[float, Range(gt=0)] = 4096.0
    inbox_samples: Annotated[int, Range(ge=1)] = 256
    reply_timeout_s: Annotated[float, Range(gt=0, note="seconds")] = 120.0
    max_restarts: Annotated[int, Range(ge=0, note="0: never")] = 2
    reprobe_every: Annotated[int, Range(ge=0, note="0: a fallback is final")] = 10

    def __post_init__(self) -> None:
        check_ranges(self)
        _require(self.refresh in ("every_step", "on_drop"),
                 f"drafter.online.refresh must be every_step or on_drop, got {self.refresh!r}")
        _require(self.source in ("auto", "engine", "actor"),
                 f"drafter.online.source must be auto, engine or actor, got {self.source!r}")
        _require(not self.max_steps_per_step or self.min_steps_per_step <= self.max_steps_per_step,
                 "drafter.online.min_steps_per_step must be <= max_steps_per_step")
        _require(self.loss is None or self.loss in ("eagle1", "eagle3", "reward_kd"),
                 f"drafter.online.loss must be eagle1, eagle3, reward_kd or null (the drafter "
                 f"kind's own loss), got {self.loss!r}")
        _require(self.device is None or re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None,
                 f"drafter.online.device must be cpu, cuda, cuda:N or null (the policy's "
                 f"model.device), got {self.device!r}")
        _require(self.compute_dtype in (None, "float32", "bfloat16"),
                 f"drafter.online.compute_dtype must be float32, bfloat16 or null (bfloat16 on "
                 f"a GPU, float32 on a CPU), got {self.compute_dtype!r}")
        _require(self.max_sample_tokens is None or self.max_sample_tokens <= self.token_budget,
                 f"drafter.online.max_sample_tokens must be in [2, token_budget="
                 f"{self.token_budget}] (a longer window would be cut to token_budget anyway) or "
                 f"null, got {self.max_sample_tokens}")
        _require(self.window_context is None or self.window_context <= self.window_tokens // 2,
                 f"drafter.online.window_context must be in [0, {self.window_tokens // 2}] (half "
                 f"a window of {self.window_tokens} tokens: the rest is what a window scores) or "
                 f"null, got {self.window_context}")

    def compute_dtype_on(self, device: str) -> str:
        """compute_dtype, or its default on `device` (bfloat16 on a GPU, float32 on a CPU)."""
        return self.compute_dtype or ("bfloat16" if device.startswith("cuda") else "float32")

    @property
    def window_tokens(self) -> int:
        """The longest DataBuffer sample (max_sample_tokens, or token_budget)."""
        return self.max_sample_tokens or self.token_budget

    @property
    def context_tokens(self) -> int:
        """Unscored tokens leading a window (window_context, or min(128, half a window))."""
        if self.window_context is not None:
            return self.window_context
        return min(128, self.window_tokens // 2)


@dataclass(frozen=True, kw_only=True, slots=True)
class DrafterConfig:
    """path: a drafter directory (`fastdraft drafter warmup`); None with the bootstrap policy
    warms one up (cached) with warmup_steps steps on warmup_rollouts rollouts. online: train it
    during the run."""

    SECTION: ClassVar[str] = "drafter"

    path: str | None = None
    kind: str = "eagle1"
    warmup_steps: Annotated[int, Range(ge=1)] = 4000
    warmup_rollouts: Annotated[int, Range(ge=1)] = 2048
    export: bool = True                 # at the end of a run: RUN_DIR/drafter + RUN_DIR/export
    online: OnlineDrafterConfig = field(default_factory=OnlineDrafterConfig)

    def __post_init__(self) -> None:
        check_ranges(self)
        from fastdraft.drafter.base import DRAFTERS
        _require(self.kind in DRAFTERS, f"drafter.kind: unknown drafter kind {self.kind!r}; "
                 f"choose one of {sorted(DRAFTERS)}")
