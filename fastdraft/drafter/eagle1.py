"""EAGLE-1 drafter: fc over concat(embed(x_{t+1}), f_t) -> one decoder layer without input norm
-> the policy's frozen lm_head. It regresses the policy's final (normed) hidden state f_{t+1}."""

from __future__ import annotations

import torch
from torch import nn

from fastdraft.drafter.base import Drafter, register_drafter
from fastdraft.models import AttnMeta, HiddenStates, KVView, ModelConfig
from fastdraft.models.layers import DecoderLayer
from fastdraft.models.rope import RopeTable


@register_drafter("eagle1")
class Eagle1Drafter(Drafter):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        h = cfg.hidden_size
        # No bias: vLLM refuses fc.bias; SGLang's exporter writes zeros for it.
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg, 0, input_norm=False)])

    def target_features(self, hidden: HiddenStates) -> torch.Tensor:
        return hidden.final

    def advance(self, features: torch.Tensor, input_ids: torch.Tensor,
                positions: torch.Tensor | RopeTable, kv: KVView | None = None,
                attn: AttnMeta | None = None) -> torch.Tensor:
        x = self.fc(torch.cat([self.embed(input_ids), features.to(self.fc.weight.dtype)], -1))
        return self.layers[0](x, self.rope_for(positions, x.dtype), kv, attn)
