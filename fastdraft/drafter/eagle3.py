"""EAGLE-3 drafter: fc over the inputs of three policy layers (by default [2, L//2, L-3]); one
layer whose attention reads concat(input_layernorm(embed(x)), hidden_norm(h)); trained with a
training-time test (the drafter's own outputs fed back for k steps).

Aux layers are counted as vLLM counts them: layer i's *input* (the output of layer i - 1, the
embedding for i = 0). SGLang and SpecForge name a layer's *output* instead (their id k is this
file's k + 1); export/imports.py and export/engine_config.py convert at the boundary."""

from __future__ import annotations

import torch
from torch import nn

from fastdraft.drafter.base import Drafter, register_drafter
from fastdraft.drafter.layout import LayerLayout
from fastdraft.errors import FastdraftError
from fastdraft.models import AttnMeta, HiddenStates, KVView, ModelConfig
from fastdraft.models.layers import DecoderLayer, RMSNorm
from fastdraft.models.rope import RopeTable


def eagle3_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The default capture SGLang and vLLM both read the same way; clamped for tiny policies."""
    return tuple(min(max(i, 0), num_layers - 1)  # type: ignore[return-value]
                 for i in (2, num_layers // 2, num_layers - 3))


@register_drafter("eagle3")
class Eagle3Drafter(Drafter):
    @classmethod
    def layer_layout(cls, target: ModelConfig) -> LayerLayout:
        # One LlamaForCausalLMEagle3 directory serves both engines for every target family, and
        # SGLang's EAGLE-3 q/k/v projections have no bias: no bias anywhere, no QK-norm.
        return LayerLayout()

    def __init__(self, cfg: ModelConfig, max_positions: int,
                 layout: LayerLayout | None = None, *, aux_layers: tuple[int, ...] | None = None,
                 head_rows: int | None = None) -> None:
        super().__init__(cfg, max_positions, layout, aux_layers=aux_layers, head_rows=head_rows)
        layers = cfg.num_hidden_layers
        if aux_layers is not None and (len(aux_layers) != 3 or not all(
                0 <= i < layers for i in aux_layers)):
            raise FastdraftError(f"EAGLE-3 aux layers {list(aux_layers)}: the drafter reads "
                                 f"three layers' inputs of the policy, whose layers are 0.."
                                 f"{layers - 1} (the policy has {layers})")
        h = cfg.hidden_size
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = DecoderLayer(self.layer_config, 0, input_norm=True, attn_input_size=2 * h)
        self.midlayer.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        if self._aux_layers is not None:
            return self._aux_layers
        return eagle3_aux_layers(self.config.num_hidden_layers)

    def target_features(self, hidden: HiddenStates) -> torch.Tensor:
        if len(hidden.aux) != 3:
            raise FastdraftError("EAGLE-3 needs the policy's aux hidden states: run the policy "
                                 f"with aux_layers={self.aux_layers}")
        return self.fc(torch.cat(hidden.aux, -1).to(self.fc.weight.dtype))

    def advance(self, features: torch.Tensor, input_ids: torch.Tensor,
                positions: torch.Tensor | RopeTable, kv: KVView | None = None,
                attn: AttnMeta | None = None) -> torch.Tensor:
        layer = self.midlayer
        emb = layer.input_layernorm(self.embed(input_ids))
        x = torch.cat([emb, layer.hidden_norm(features)], -1)
        # The layer's own input norm is applied above (to the embedding half only).
        rope = self.rope_for(positions, x.dtype)
        h = features + layer.self_attn(x, rope, kv, attn)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def head_input(self, out: torch.Tensor) -> torch.Tensor:
        return self.norm(out)
