"""CausalLM: the one decoder used by the rollout engine, the actor trainer and (through
DecoderLayer) the drafter. Module tree and parameter names mirror HF's *ForCausalLM."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from fastdraft.models.attn_meta import AttnMeta, GroupedAttn, KVView, PackedSeqs
from fastdraft.models.config import ModelConfig
from fastdraft.models.layers import DecoderLayer, RMSNorm
from fastdraft.models.rope import RotaryEmbedding
from fastdraft.models.tensor_parallel import (
    TPRank,
    local_tensors,
    shard_config,
    use_row_parallel,
)


class HiddenStates(NamedTuple):
    final: torch.Tensor               # [B, T, H] after the final norm (what lm_head reads)
    aux: tuple[torch.Tensor, ...]     # inputs of the requested layers, each [B, T, H]


class DecoderBody(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """tp: this model is one rank's slice of a tensor-parallel replica (models/
    tensor_parallel.py). `config` is the whole model's (what drafters and checkpoints match),
    `local_config` this rank's slice (1/k of the heads, KV heads and MLP features: what its
    layers and KV cache hold); full tensors cross by `local_tensors`."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None,
                 tp: TPRank | None = None) -> None:
        super().__init__()
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.config = cfg
        self.local_config = cfg if self.tp is None else shard_config(cfg, self.tp.size)
        self.model = DecoderBody(self.local_config)
        if self.tp is not None:
            use_row_parallel(self.model.layers, self.tp)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                    cfg.max_position_embeddings,
                                    max_positions or cfg.max_position_embeddings)

    def tie_weights(self) -> None:
        """Tied checkpoints store one matrix; re-tie after anything that rebuilds parameters."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def local_tensors(self, named: Iterable[tuple[str, torch.Tensor]]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors by HF name -> this model's (its tensor-parallel slices; as they are
        without tensor parallelism)."""
        return local_tensors(self.tp, named)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv: KVView | None = None,
                attn: AttnMeta | GroupedAttn | PackedSeqs | None = None, *,
                logit_index: torch.Tensor | None = None, aux_layers: tuple[int, ...] = (),
                score: Callable[[torch.Tensor, torch.Tensor], Any] | None = None
                ) -> tuple[Any, HiddenStates]:
        """input_ids, positions: [B, T] -> (logits, hidden).

        logit_index: [B, K] token indices whose logits are wanted (e.g. the last prompt token in
        prefill); default all T. hidden.final is always [B, T, H] so drafters can read any token.
        aux_layers: layer indices whose *inputs* are returned, in this order (EAGLE-3).
        score: instead of the logits, score(final hidden [B, T, H], lm_head weight [V, H]) is
        returned (the actor's chunked log-softmax, algo/answer_scores.py): inside this forward,
        where a sharded model's head is gathered.
        """
        h = self.model.embed_tokens(input_ids)
        rope = self.rope(positions, h.dtype)
        if attn is not None and (kv is None or kv.reads_mask):   # converted once, not per layer
            attn = attn.with_bias(h.dtype)
        captured = {}
        for i, layer in enumerate(self.model.layers):
            if i in aux_layers:
                captured[i] = h
            h = layer(h, rope, kv, attn)
        final = self.model.norm(h)
        hidden = HiddenStates(final, tuple(captured[i] for i in aux_layers))
        if score is not None:
            return score(final, self.lm_head.weight), hidden
        picked = final if logit_index is None else torch.gather(
            final, 1, logit_index.unsqueeze(-1).expand(-1, -1, final.shape[-1]))
        return self.lm_head(picked), hidden
