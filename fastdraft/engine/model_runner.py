"""The one place that touches the device: owns the policy model and its slot KV cache and turns a
scheduled batch into a forward pass. Static cache shapes keep the decode step graph-capturable."""

from __future__ import annotations

import torch

from fastdraft.engine.spec.tree import DraftTree
from fastdraft.models import AttnMeta, CausalLM, HiddenStates, KVView, causal_cache_meta
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
        shape = (num_slots, cfg.num_key_value_heads, cache_len, cfg.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                        for _ in range(cfg.num_hidden_layers)]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                        for _ in range(cfg.num_hidden_layers)]
        self._last_slots: tuple[int, ...] = ()
        self._last_kv: KVView | None = None

    def _kv(self, slots: list[int]) -> KVView:
        key = tuple(slots)
        if key != self._last_slots:  # the decode batch is the same step after step
            start = slots[0]
            is_range = slots == list(range(start, start + len(slots)))
            self._last_kv = KVView(self.k_cache, self.v_cache,
                                   torch.tensor(slots, device=self.device),
                                   start if is_range else None)
            self._last_slots = key
        return self._last_kv

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
    def verify(self, root_ids: list[int], root_pos: list[int], trees: list[DraftTree],
               slots: list[int], aux_layers: tuple[int, ...] = ()
               ) -> tuple[torch.Tensor, HiddenStates]:
        """One policy forward over [root, tree nodes] per request -> (logits [B, 1 + N, V],
        hidden [B, 1 + N, H]). Root at its position; node i at root_pos + depth(i), its K/V in
        the scratch cells root_pos + 1 + i; each node sees the context and its own ancestors."""
        batch, width = len(trees), 1 + max(t.num_nodes for t in trees)
        ids = torch.zeros(batch, width, dtype=torch.long)
        pos = torch.zeros(batch, width, dtype=torch.long)
        cache_pos = torch.zeros(batch, width, dtype=torch.long)
        ctx_len = max(root_pos) + width
        mask = torch.zeros(batch, width, ctx_len, dtype=torch.bool)
        root = torch.tensor(root_pos)
        ids[:, 0] = torch.tensor(root_ids)
        pos[:] = root.unsqueeze(1)
        cache_pos[:] = root.unsqueeze(1) + torch.arange(width)
        mask[:] = torch.arange(ctx_len) <= root.view(-1, 1, 1)
        for b, (tree, p) in enumerate(zip(trees, root_pos)):
            n = tree.num_nodes
            if n:
                ids[b, 1 : n + 1] = tree.tokens.cpu()
                pos[b, 1 : n + 1] += torch.tensor(tree.depth_list())
                mask[b, 1 : n + 1, p + 1 : p + 1 + n] = tree.ancestor_mask()
        dev = self.device
        meta = AttnMeta(mask.to(dev), cache_positions=cache_pos.to(dev))
        logits, hidden = self.step_model(ids.to(dev), pos.to(dev), self._kv(slots), meta,
                                         aux_layers=aux_layers)
        return logits, hidden

    @torch.inference_mode()
    def compact(self, slots: list[int], src: list[int], dst: list[int]) -> None:
        """Moves accepted tree nodes' K/V from their scratch cells to their final positions."""
        if not src:
            return
        s = torch.tensor(slots, device=self.device)
        src_t, dst_t = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        for cache in (*self.k_cache, *self.v_cache):
            cache[s, :, dst_t] = cache[s, :, src_t]
