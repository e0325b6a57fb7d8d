"""EAGLE-1 drafter: fc over concat(embed(x_{t+1}), f_t) -> one decoder layer without input norm
-> the policy's frozen lm_head. It regresses the policy's final (normed) hidden state f_{t+1}."""

from __future__ import annotations

import torch
from torch import nn

from fastdraft.drafter.base import Drafter, register_drafter
from fastdraft.drafter.layout import LayerLayout
from fastdraft.errors import FastdraftError
from fastdraft.models import AttnMeta, HiddenStates, KVView, ModelConfig
from fastdraft.models.layers import DecoderLayer
from fastdraft.models.rope import RopeTable


@register_drafter("eagle1")
class Eagle1Drafter(Drafter):
    @classmethod
    def layer_layout(cls, target: ModelConfig) -> LayerLayout:
        # The engines' EAGLE-1 layers: SGLang's Qwen2ForCausalLMEagle always has q/k/v biases,
        # its LlamaForCausalLMEagle (Llama and Qwen3 targets) one switch for q/k/v/o biases,
        # vLLM's LlamaForCausalLM a switch each for q/k/v (qkv_bias) and o_proj
        # (attention_bias); so the target's attention biases stay. None of them has QK-norm
        # (a Qwen3 target's drafter is a Llama EAGLE layer), and SGLang's MLP has no bias.
        return LayerLayout(qkv_bias=target.qkv_bias, o_proj_bias=target.o_proj_bias)

    def __init__(self, cfg: ModelConfig, max_positions: int,
                 layout: LayerLayout | None = None, *, aux_layers: tuple[int, ...] | None = None,
                 head_rows: int | None = None) -> None:
        if aux_layers is not None or head_rows is not None:
            raise FastdraftError("an EAGLE-1 drafter reads the policy's final hidden state "
                                 "through the policy's own lm_head: aux layers and an own "
                                 "lm_head are EAGLE-3's")
        super().__init__(cfg, max_positions, layout)
        h = cfg.hidden_size
        # No bias: vLLM refuses fc.bias; SGLang's exporter writes zeros for it.
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(self.layer_config, 0, input_norm=False)])

    def target_features(self, hidden: HiddenStates) -> torch.Tensor:
        return hidden.final

    def advance(self, features: torch.Tensor, input_ids: torch.Tensor,
                positions: torch.Tensor | RopeTable, kv: KVView | None = None,
                attn: AttnMeta | None = None) -> torch.Tensor:
        x = self.fc(torch.cat([self.embed(input_ids), features.to(self.fc.weight.dtype)], -1))
        return self.layers[0](x, self.rope_for(positions, x.dtype), kv, attn)
