"""Decoder building blocks. HF parameter names (q_proj, gate_proj, input_layernorm, ...) are kept
so checkpoints load, save and push with no renaming; the drafter reuses DecoderLayer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastdraft.models.attn_meta import AttnMeta, GroupedAttn, KVView, PackedSeqs
from fastdraft.models.config import ModelConfig
from fastdraft.models.packing import pack_linears
from fastdraft.models.rope import RopeTable, rotate


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference implementations, then cast back.
        if x.dtype == torch.float32:
            return F.rms_norm(x, x.shape[-1:], self.weight, eps=self.eps)
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, input_size: int | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        in_size = input_size or cfg.hidden_size
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(in_size, q_size, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(in_size, kv_size, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(in_size, kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.has_qk_norm = cfg.qk_norm
        self.packed_qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def pack_for_inference(self) -> None:
        self.packed_qkv = pack_linears([self.q_proj, self.k_proj, self.v_proj])

    def _qkv(self, x: torch.Tensor, rope: RopeTable
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, in] -> rotated q [B, T, Hq, D], rotated k and v [B, T, Hkv, D]."""
        bsz, seq_len, _ = x.shape
        nq, nkv = self.num_heads, self.num_kv_heads
        if self.packed_qkv is not None and not torch.is_grad_enabled():
            qkv = F.linear(x, *self.packed_qkv).view(bsz, seq_len, nq + 2 * nkv, self.head_dim)
            if not self.has_qk_norm:  # rotate q and k in one go
                qk = rotate(qkv[:, :, : nq + nkv], rope)
                return qk[:, :, :nq], qk[:, :, nq:], qkv[:, :, nq + nkv:]
            q, k, v = qkv.split([nq, nkv, nkv], dim=2)
        else:
            q = self.q_proj(x).view(bsz, seq_len, nq, self.head_dim)
            k = self.k_proj(x).view(bsz, seq_len, nkv, self.head_dim)
            v = self.v_proj(x).view(bsz, seq_len, nkv, self.head_dim)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return rotate(q, rope), rotate(k, rope), v

    def forward(self, x: torch.Tensor, rope: RopeTable, kv: KVView | None,
                attn: AttnMeta | GroupedAttn | PackedSeqs | None) -> torch.Tensor:
        """x: [B, T, in_size], rope: cos/sin of the tokens' positions -> [B, T, hidden]
        (GroupedAttn: B = 1, the groups' rows packed along T; each group brings its own KV;
        PackedSeqs: B = 1, training sequences packed along T)."""
        bsz, seq_len, _ = x.shape
        q, k, v = self._qkv(x, rope)
        if isinstance(attn, GroupedAttn):
            return self.o_proj(self._grouped(q, k, v, attn))
        if isinstance(attn, PackedSeqs):
            return self.o_proj(self._packed(q, k, v, attn))
        if kv is not None:
            assert attn is not None and attn.cache_positions is not None
            return self.o_proj(self._cached(q, k, v, kv, attn).reshape(bsz, seq_len, -1))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=None if attn is None else attn.sdpa_mask, is_causal=attn is None,
            enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq_len, -1))

    def _packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: PackedSeqs
                ) -> torch.Tensor:
        """q [1, N, Hq, D], k and v [1, N, Hkv, D] of packed sequences -> [1, N, Hq * D]."""
        outs = []
        for start, length, count in attn.runs():
            end = start + length * count
            q_, k_, v_ = (t[0, start:end].unflatten(0, (count, length)).transpose(1, 2)
                          for t in (q, k, v))
            out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True,
                                                 enable_gqa=self.num_heads != self.num_kv_heads)
            outs.append(out.transpose(1, 2).reshape(1, length * count, -1))
        return torch.cat(outs, 1)

    def _cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVView,
                attn: AttnMeta) -> torch.Tensor:
        """q [B, T, Hq, D], the new k and v [B, T, Hkv, D] -> attention over the cache, [B, T,
        Hq, D] (the new K/V stored first). A paged cache is read by kv.paged_attention where
        set, else in chunks (kv.chunks: each chunk's rows gathered only to its own longest
        row), else in one gather."""
        gqa = self.num_heads != self.num_kv_heads
        if kv.paged_attention is not None:     # a kernel reads the rows' blocks in place
            _paged_write(kv, self.layer_idx, k, v)
            return kv.paged_attention(q, kv.k[self.layer_idx], kv.v[self.layer_idx], kv.table,
                                      kv.ctx_lens, kv.new_mask)
        if kv.chunks is None:
            keys, values = _write_and_read(kv, self.layer_idx, k, v, attn)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values,
                                                 attn_mask=attn.sdpa_mask, enable_gqa=gqa)
            return out.transpose(1, 2)
        _paged_write(kv, self.layer_idx, k, v)
        caches = kv.k[self.layer_idx], kv.v[self.layer_idx]
        out = torch.empty_like(q)
        for chunk in kv.chunks:
            keys, values = (_gather(c, chunk.pages, chunk.rows.shape[0], chunk.ctx_len)
                            for c in caches)
            part = F.scaled_dot_product_attention(q.index_select(0, chunk.rows).transpose(1, 2),
                                                  keys, values, attn_mask=chunk.bias,
                                                  enable_gqa=gqa)
            out.index_copy_(0, chunk.rows, part.transpose(1, 2))
        return out

    def _grouped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 attn: GroupedAttn) -> torch.Tensor:
        """q [1, N, Hq, D], k and v [1, N, Hkv, D] packed by group -> attention out [1, N,
        Hq * D]: each group's tokens as [rows, width] against its rows' caches."""
        outs, start = [], 0
        for group in attn.groups:
            rows, width, end = group.num_rows, group.width, start + group.num_tokens
            qg, kg, vg = (t[0, start:end].unflatten(0, (rows, width)) for t in (q, k, v))
            out = self._cached(qg, kg, vg, group.kv, group.attn)
            outs.append(out.reshape(1, group.num_tokens, -1))
            start = end
        return torch.cat(outs, 1)


def _write_and_read(kv: KVView, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
                    attn: AttnMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """Stores the new K/V in each row's slot, returns [B, Hkv, ctx_len, D] keys and values
    (views of the cache: rows are consecutive slots; a paged cache gathers each row's blocks)."""
    if kv.table is not None:
        return _paged_write_and_read(kv, layer_idx, k, v, attn.ctx_len)
    k_cache, v_cache = kv.rows(layer_idx, k.shape[0])
    rows = kv.row_ids if kv.row_ids is not None else torch.arange(
        k.shape[0], device=k.device).unsqueeze(1)
    if k.dtype != k_cache.dtype:
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k_cache[rows, :, attn.cache_positions] = k
    v_cache[rows, :, attn.cache_positions] = v
    ctx_len = attn.ctx_len
    return k_cache[:, :, :ctx_len], v_cache[:, :, :ctx_len]


def _paged_write(kv: KVView, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """The new K/V [B, T, Hkv, D] to their (block, offset) in layer layer_idx's pool."""
    assert kv.write_at is not None
    k_cache, v_cache = kv.k[layer_idx], kv.v[layer_idx]
    block, offset = kv.write_at
    if k.dtype != k_cache.dtype:
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k_cache[block, offset] = k
    v_cache[block, offset] = v


def _paged_write_and_read(kv: KVView, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
                          ctx_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """_write_and_read over blocks: the new K/V go to their (block, offset); a row's first
    ctx_len cells are gathered from its blocks (the torch path; kernels/ reads them in place)."""
    _paged_write(kv, layer_idx, k, v)
    assert kv.table is not None
    batch, block_size = kv.table.shape[0], kv.k[layer_idx].shape[1]
    if kv.span_start is not None:   # one row, its blocks consecutive: a view of the pool
        end = kv.span_start + -(-ctx_len // block_size)
        return tuple(c[kv.span_start: end].view(1, -1, *c.shape[2:])[:, :ctx_len].transpose(1, 2)
                     for c in (kv.k[layer_idx], kv.v[layer_idx]))
    pages = kv.table[:, : -(-ctx_len // block_size)].flatten()
    return tuple(_gather(c, pages, batch, ctx_len) for c in (kv.k[layer_idx], kv.v[layer_idx]))


def _gather(cache: torch.Tensor, pages: torch.Tensor, rows: int, ctx_len: int) -> torch.Tensor:
    """pages [rows * blocks] of one layer's pool [blocks, block_size, Hkv, D] -> the rows'
    first ctx_len cells as [rows, Hkv, ctx_len, D] (index_select: one contiguous copy;
    advanced indexing is ~20% slower on CPU)."""
    return (cache.index_select(0, pages).view(rows, -1, *cache.shape[2:])[:, :ctx_len]
            .transpose(1, 2))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.packed_gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def pack_for_inference(self) -> None:
        self.packed_gate_up = pack_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_gate_up is not None and not torch.is_grad_enabled():
            gate, up = F.linear(x, *self.packed_gate_up).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP. `input_norm=False` gives the EAGLE-1 drafter's layer."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, input_norm: bool = True,
                 attn_input_size: int | None = None) -> None:
        super().__init__()
        if input_norm:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.has_input_norm = input_norm
        self.self_attn = Attention(cfg, layer_idx, attn_input_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope: RopeTable, kv: KVView | None,
                attn: AttnMeta | GroupedAttn | PackedSeqs | None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, attn_input_size]; residual defaults to x (differs when x is a concat)."""
        residual = x if residual is None else residual
        h = self.input_layernorm(x) if self.has_input_norm else x
        h = residual + self.self_attn(h, rope, kv, attn)
        return h + self.mlp(self.post_attention_layernorm(h))
