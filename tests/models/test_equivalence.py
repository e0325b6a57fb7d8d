"""Our decoder vs transformers' own implementation, on random tiny configs of each family (fp32)."""

from __future__ import annotations

import pytest
import torch
import transformers

from fastdraft.models import AttnMeta, KVView, causal_cache_meta, load_model

TOL = 1e-4

FAMILY_CONFIGS = {
    "llama": (transformers.LlamaConfig, dict(attention_bias=True, mlp_bias=True)),
    "llama-rope-llama3": (transformers.LlamaConfig, dict(rope_scaling=dict(
        rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "llama-rope-linear": (transformers.LlamaConfig, dict(rope_scaling=dict(
        rope_type="linear", factor=2.0))),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen2-rope-yarn": (transformers.Qwen2Config, dict(rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32))),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=24)),
    "qwen3-bias": (transformers.Qwen3Config, dict(attention_bias=True, tie_word_embeddings=True)),
}


def _hf_model(name: str, tmp_path):
    cls, extra = FAMILY_CONFIGS[name]
    cfg = cls(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rope_theta=1000.0, **extra)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():  # random biases / norms so every parameter matters
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.eval().save_pretrained(tmp_path)
    return hf, load_model(tmp_path, max_positions=128)


def _cache(model, num_slots: int, max_len: int) -> tuple[list, list]:
    cfg = model.config
    shape = (num_slots, cfg.num_key_value_heads, max_len, cfg.head_dim)
    return ([torch.zeros(shape) for _ in range(cfg.num_hidden_layers)],
            [torch.zeros(shape) for _ in range(cfg.num_hidden_layers)])


@pytest.mark.parametrize("name", sorted(FAMILY_CONFIGS))
def test_prefill_matches_transformers(name, tmp_path):
    hf, ours = _hf_model(name, tmp_path)
    ids = torch.randint(0, 97, (2, 40))
    pos = torch.arange(40).expand(2, -1)
    with torch.no_grad():
        ref = hf(ids).logits
        logits, hidden = ours(ids, pos)
        ref_hidden = hf(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(logits, ref, atol=TOL, rtol=0)
    torch.testing.assert_close(hidden.final, ref_hidden[-1], atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_cached_prefill_then_decode_matches(name, tmp_path):
    """Prefill prompts of different lengths into slots 1 and 2, then decode one by one (each row
    with its own length: one context bucket for both)."""
    hf, ours = _hf_model(name, tmp_path)
    lens, num_new = [7, 12], 6
    seqs = [torch.randint(0, 97, (n + num_new,)) for n in lens]
    k, v = _cache(ours, num_slots=4, max_len=64)
    width = max(lens)
    ids = torch.zeros(2, width, dtype=torch.long)
    for row, (seq, n) in enumerate(zip(seqs, lens)):
        ids[row, :n] = seq[:n]
    pos = torch.arange(width).expand(2, -1)
    with torch.no_grad():
        logits, _ = ours(ids, pos, KVView(k, v, 1), causal_cache_meta(pos, width),
                         logit_index=torch.tensor([[lens[0] - 1], [lens[1] - 1]]))
        for row, (seq, n) in enumerate(zip(seqs, lens)):
            torch.testing.assert_close(logits[row, 0], hf(seq[None, :n]).logits[0, -1],
                                       atol=TOL, rtol=0)
        for step in range(num_new):
            cur = torch.tensor([[lens[0] + step], [lens[1] + step]])
            tok = torch.stack([seqs[r][cur[r, 0]] for r in range(2)]).view(2, 1)
            logits, _ = ours(tok, cur, KVView(k, v, 1), causal_cache_meta(cur, 32))
            for row, seq in enumerate(seqs):
                ref = hf(seq[None, : cur[row, 0] + 1]).logits[0, -1]
                torch.testing.assert_close(logits[row, 0], ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_tree_mask_matches_path_forward(name, tmp_path):
    """A draft tree verified in one forward with an arbitrary mask: each node's logits equal a plain
    forward over prefix + the node's root path (what speculative verification relies on)."""
    hf, ours = _hf_model(name, tmp_path)
    prefix = torch.randint(0, 97, (9,))
    # tree: parents[i] is the parent node index (-1 = the prefix's last token)
    parents = [-1, -1, 0, 0, 1, 2, 5]
    tokens = torch.randint(0, 97, (len(parents),))
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    n = len(prefix)
    k, v = _cache(ours, num_slots=2, max_len=64)
    kv = KVView(k, v, slot_start=1)
    pos = torch.arange(n).view(1, -1)
    with torch.no_grad():
        ours(prefix.view(1, -1), pos, kv, causal_cache_meta(pos, n))
        ctx = n + len(parents)
        mask = torch.zeros(1, len(parents), ctx, dtype=torch.bool)
        mask[0, :, :n] = True
        for i in range(len(parents)):
            j = i
            while j >= 0:
                mask[0, i, n + j] = True
                j = parents[j]
        tree_pos = torch.tensor([[n + d for d in depth]])
        meta = AttnMeta(mask=mask, cache_positions=torch.arange(n, ctx).view(1, -1))
        logits, _ = ours(tokens.view(1, -1), tree_pos, kv, meta)
        for i in range(len(parents)):
            path, j = [], i
            while j >= 0:
                path.append(int(tokens[j]))
                j = parents[j]
            seq = torch.cat([prefix, torch.tensor(path[::-1])])
            ref = hf(seq[None]).logits[0, -1]
            torch.testing.assert_close(logits[0, i], ref, atol=TOL, rtol=0)


def test_aux_layers_are_layer_inputs(tmp_path):
    hf, ours = _hf_model("qwen3", tmp_path)
    ids = torch.randint(0, 97, (1, 10))
    with torch.no_grad():
        _, hidden = ours(ids, torch.arange(10).view(1, -1), aux_layers=(0, 2))
        ref = hf(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(hidden.aux[0], ref[0], atol=TOL, rtol=0)
    torch.testing.assert_close(hidden.aux[1], ref[2], atol=TOL, rtol=0)
