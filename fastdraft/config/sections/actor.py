"""The `actor` section: the policy being trained."""

from __future__ import annotations

from dataclasses import dataclass

from fastdraft.config.sections.common import DTYPES
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
    (algo/answer_scores.py)."""

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
    pack_sequences: bool = True
    logits_chunk_tokens: int = 4096

    def __post_init__(self) -> None:
        _require(self.lr > 0, "actor.lr must be > 0")
        _require(self.updates_per_step >= 1 and self.micro_batch_tokens >= 1,
                 "actor.updates_per_step and actor.micro_batch_tokens must be >= 1")
        _require(self.compute_dtype in DTYPES, f"actor.compute_dtype must be one of {DTYPES}, "
                 f"got {self.compute_dtype!r}")
        _require(self.num_ranks >= 1, "actor.num_ranks must be >= 1")
        _require(self.logits_chunk_tokens >= 0, "actor.logits_chunk_tokens must be >= 0 (0: a "
                 f"micro-batch's logits at once), got {self.logits_chunk_tokens}")


