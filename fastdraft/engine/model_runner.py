"""The one place that touches the device: owns the policy model and its slot KV cache and turns a
scheduled batch into a forward pass. Static cache shapes keep the decode step graph-capturable."""

from __future__ import annotations

import torch

from fastdraft.models import CausalLM, KVView, causal_cache_meta
from fastdraft.models.packing import pack_for_inference


class ModelRunner:
    def __init__(self, model: CausalLM, num_slots: int, max_seq_len: int) -> None:
        self.model = pack_for_inference(model)
        cfg = model.config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_seq_len = max_seq_len
        shape = (num_slots, cfg.num_key_value_heads, max_seq_len, cfg.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                        for _ in range(cfg.num_hidden_layers)]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                        for _ in range(cfg.num_hidden_layers)]

    def _kv(self, slots: list[int]) -> KVView:
        start = slots[0]
        is_range = slots == list(range(start, start + len(slots)))
        slot_ids = torch.tensor(slots, device=self.device)
        return KVView(self.k_cache, self.v_cache, slot_ids, start if is_range else None)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], slots: list[int]) -> torch.Tensor:
        """Right-padded batched prefill; returns the last prompt token's logits [B, V]. Padding
        writes junk K/V past each prompt's end, which decode overwrites before anything reads it."""
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.tensor(prompt)
        positions = torch.arange(width, device=self.device).expand(len(prompts), -1)
        last = torch.tensor([[len(p) - 1] for p in prompts], device=self.device)
        logits, _ = self.model(ids.to(self.device), positions, self._kv(slots),
                               causal_cache_meta(positions, width), logit_index=last)
        return logits[:, 0]

    @torch.inference_mode()
    def decode(self, token_ids: list[int], positions: list[int], slots: list[int]
               ) -> torch.Tensor:
        """One token per request at its position; returns logits [B, V]."""
        pos = torch.tensor(positions, device=self.device).unsqueeze(1)
        ids = torch.tensor(token_ids, device=self.device).unsqueeze(1)
        logits, _ = self.model(ids, pos, self._kv(slots),
                               causal_cache_meta(pos, max(positions) + 1))
        return logits[:, 0]
