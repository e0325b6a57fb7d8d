"""The online drafter trainer's memory on its device: what a hybrid worker's trainer member
(workers/hybrid.py) adds to the worker's device, beside the engine replica and the actor rank.

- state, for the whole run: the drafter's own parameters (its layers and draft head; it
  borrows the policy's embedding and lm_head) as fp32 masters, their gradients and AdamW's two
  moments: 16 bytes a parameter;
- the policy head it reads (trainer/service.POLICY_HEAD: embedding and lm_head, once when
  tied), a copy in the serving dtype;
- a micro-step's transient: over token_budget tokens, the policy's next-token distribution
  (the target) and the drafter's logits in fp32 and their gradient, [tokens, vocab] each
  (the drafter's one layer's activations are small beside them).
The DataBuffer (drafter.online.buffer_mb) is host memory: counted only where the device is the
host (a CPU run). The numbers are upper bounds of what the trainer allocates, not measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastdraft.config.sections import OnlineDrafterConfig
    from fastdraft.models import ModelConfig

_FP32 = 4
_STATE_PER_PARAM = 4 * _FP32   # master, gradient, AdamW's exp_avg and exp_avg_sq


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerPlan:
    """Bytes of one trainer member on its device; `total` what the run plan adds."""

    params: int       # the drafter's trainable parameters
    state: int
    head: int
    transient: int
    buffer: int       # host memory (counted in total only on a CPU)
    on_cpu: bool

    @classmethod
    def of(cls, config: ModelConfig, online: OnlineDrafterConfig, drafter_weights: int,
           serving_bytes: int, on_cpu: bool) -> TrainerPlan:
        """drafter_weights: the engine plan's bytes of the drafter's own layers, in the
        serving dtype of serving_bytes a value."""
        params = drafter_weights // serving_bytes
        vocab_hidden = config.vocab_size * config.hidden_size
        head = vocab_hidden * serving_bytes * (1 if config.tie_word_embeddings else 2)
        transient = 3 * online.token_budget * config.vocab_size * _FP32
        return cls(params=params, state=_STATE_PER_PARAM * params, head=head,
                   transient=transient, buffer=int(online.buffer_mb * 2**20), on_cpu=on_cpu)

    @property
    def total(self) -> int:
        return self.state + self.head + self.transient + (self.buffer if self.on_cpu else 0)
