"""The `actor` section: the policy being trained."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar

from fastdraft.config.sections.common import DTYPES, Range, check_ranges
from fastdraft.config.sections.common import require as _require


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
    for the update; the activations of a micro-batch shrink ~20x at a 7B shape).
    pack_sequences: a micro-batch's sequences lie end to end without padding (attention
    within each; micro_batch_tokens then counts real tokens), else right-padded rows grouped
    by length. logits_chunk_tokens: answer tokens whose logits exist at once in the update,
    the gate's statistics and the reference's logprobs (the backward makes them again; 0: a
    whole micro-batch's at once); a prompt's logits are never made
    (algo/answer_scores.py). grad_clip: the global gradient norm is clipped to it (None: not
    clipped, the norm still measured)."""

    SECTION: ClassVar[str] = "actor"

    lr: Annotated[float, Range(gt=0)] = 1e-5
    weight_decay: Annotated[float, Range(ge=0)] = 0.0
    betas: Annotated[tuple[float, float], Range(ge=0, lt=1)] = (0.9, 0.999)
    warmup_steps: Annotated[int, Range(ge=0, note="0: the full lr from the first step")] = 0
    grad_clip: Annotated[float | None, Range(gt=0, note="no clipping")] = 1.0
    updates_per_step: Annotated[int, Range(ge=1)] = 1
    micro_batch_tokens: Annotated[int, Range(ge=1)] = 8192
    compute_dtype: str = "float32"
    num_ranks: Annotated[int, Range(ge=1)] = 1
    activation_checkpointing: bool = False
    pack_sequences: bool = True
    logits_chunk_tokens: Annotated[int, Range(ge=0, note="0: a micro-batch's logits at once")] \
        = 4096

    def __post_init__(self) -> None:
        check_ranges(self)
        _require(self.compute_dtype in DTYPES, f"actor.compute_dtype must be one of {DTYPES}, "
                 f"got {self.compute_dtype!r}")


