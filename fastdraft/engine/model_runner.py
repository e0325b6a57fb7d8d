"""The one place that touches the device: owns the policy model and its slot KV cache and turns a
scheduled batch into a forward pass. Static cache shapes keep the decode step graph-capturable."""

from __future__ import annotations

import torch

from fastdraft.engine.spec.batch import DraftBatch
from fastdraft.models import AttnMeta, CausalLM, HiddenStates, causal_cache_meta
from fastdraft.models.attn_meta import KVViews
from fastdraft.models.packing import pack_for_inference


class ModelRunner:
    """compile=True runs decode and verify through torch.compile (dynamic shapes; CPU and GPU):
    fewer, fused kernels per step. Prefill and the first calls of each new shape stay eager-speed
    while compiling; compile=False is the plain eager path the tests exercise."""

    def __init__(self, model: CausalLM, num_slots: int, cache_len: int,
                 compile: bool = False) -> None:
        self.model = pack_for_inference(model)
        self.step_model = torch.compile(self.model, dynamic=True) if compile else self.model
        cfg = model.config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cache_len = cache_len
        # One tensor for every layer's K and V: moving accepted draft K/V is then one copy.
        self.kv_cache = torch.zeros(cfg.num_hidden_layers, 2, num_slots, cfg.num_key_value_heads,
                                    cache_len, cfg.head_dim, dtype=self.dtype, device=self.device)
        self.k_cache = list(self.kv_cache[:, 0].unbind(0))
        self.v_cache = list(self.kv_cache[:, 1].unbind(0))
        self._kv = KVViews(self.k_cache, self.v_cache)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], slots: list[int], aux_layers: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, HiddenStates]:
        """Right-padded batched prefill -> (last prompt token's logits [B, V], hidden states of
        every prompt token [B, T, H]). Padding writes junk K/V past each prompt's end, which
        decode overwrites before anything reads it."""
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.tensor(prompt)
        positions = torch.arange(width, device=self.device).expand(len(prompts), -1)
        last = torch.tensor([[len(p) - 1] for p in prompts], device=self.device)
        logits, hidden = self.model(ids.to(self.device), positions, self._kv(slots),
                                    causal_cache_meta(positions, width), logit_index=last,
                                    aux_layers=aux_layers)
        return logits[:, 0], hidden

    @torch.inference_mode()
    def decode(self, token_ids: list[int], positions: list[int], slots: list[int]
               ) -> torch.Tensor:
        """One token per request at its position; returns logits [B, V]."""
        pos = torch.tensor(positions, device=self.device).unsqueeze(1)
        ids = torch.tensor(token_ids, device=self.device).unsqueeze(1)
        ctx_len = max(positions) + 1
        logits, _ = self.step_model(ids, pos, self._kv(slots), causal_cache_meta(
            pos, ctx_len, sees_all=min(positions) == ctx_len - 1))
        return logits[:, 0]

    @torch.inference_mode()
    def verify(self, root_ids: list[int], root_pos: list[int], drafts: DraftBatch,
               slots: list[int], aux_layers: tuple[int, ...] = ()
               ) -> tuple[torch.Tensor, HiddenStates]:
        """One policy forward over [root, tree nodes] per request -> (logits [B, 1 + N, V],
        hidden [B, 1 + N, H]). The root sits at its position; node i at root_pos + depth(i), its
        K/V in scratch cell `tree_start(root_pos) + i` (past every row's context); each node sees
        its row's context and its own ancestors."""
        dev = self.device
        batch, num = drafts.tokens.shape
        start = self.tree_start(root_pos)
        root_id, root = torch.tensor([root_ids, root_pos], device=dev).unsqueeze(-1)  # [B, 1]
        ids = torch.cat([root_id, drafts.tokens], 1)
        pos = torch.cat([root, root + drafts.depths], 1)
        cache_pos = torch.cat([root, torch.arange(start, start + num, device=dev).expand(
            batch, -1)], 1)
        sees_context = (torch.arange(start, device=dev) <= root).unsqueeze(1)   # [B, 1, start]
        sees_tree = torch.cat([torch.zeros(batch, 1, num, dtype=torch.bool, device=dev),
                               drafts.ancestors], 1)                         # [B, 1 + N, N]
        mask = torch.cat([sees_context.expand(-1, 1 + num, -1), sees_tree], 2)
        return self.step_model(ids, pos, self._kv(slots), AttnMeta(mask, cache_positions=cache_pos),
                               aux_layers=aux_layers)

    @staticmethod
    def tree_start(root_pos: list[int]) -> int:
        """First scratch cell of a verify step's draft nodes (the same column for every row)."""
        return max(root_pos) + 1

    @torch.inference_mode()
    def compact(self, slots: list[int], src: list[int], dst: list[int]) -> None:
        """Moves accepted tree nodes' K/V from their scratch cells to their final positions."""
        if not src:
            return
        s, src_t, dst_t = torch.tensor([slots, src, dst], device=self.device)
        self.kv_cache[:, :, s, :, dst_t] = self.kv_cache[:, :, s, :, src_t]
