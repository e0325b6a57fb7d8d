"""Tiny policies (one per family the exporter distinguishes) and saved drafters for them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fastdraft.drafter import Drafter, build_drafter, save_drafter
from fastdraft.engine.spec.draft_head import DraftHead
from fastdraft.models import CausalLM, load_model
from tests.conftest import make_tiny_checkpoint

MAX_POSITIONS = 32


@pytest.fixture(scope="session")
def llama_policy_dir(tmp_path_factory) -> Path:
    # Untied, so an EAGLE-3 export reads lm_head.weight itself; 4 layers for distinct aux layers.
    path = tmp_path_factory.mktemp("llama-policy")
    make_tiny_checkpoint(path, model_type="llama", num_hidden_layers=4, tie_word_embeddings=False)
    return path


@pytest.fixture(scope="session")
def qwen2_policy_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen2-policy")  # tied: lm_head is the embedding
    make_tiny_checkpoint(path, model_type="qwen2")
    return path


def saved_drafter(policy: CausalLM, kind: str, out: Path, seed: int = 0,
                  draft_token_ids: list[int] | None = None) -> Drafter:
    """A random drafter whose weights are bfloat16 values (the export's dtype), so an exported
    and reloaded copy must compute bit-identical outputs."""
    torch.manual_seed(seed)
    drafter = build_drafter(kind, policy.config, MAX_POSITIONS).attach(policy)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # norms away from 1, biases away from 0
            p.copy_(p.to(torch.bfloat16).float())
    if draft_token_ids is not None:
        drafter.draft_token_ids = torch.tensor(draft_token_ids)
    save_drafter(drafter, out)
    return drafter.eval()


def load_policy(path: Path) -> CausalLM:
    return load_model(path, max_positions=MAX_POSITIONS)


def assert_same_steps(original: Drafter, reloaded: Drafter) -> None:
    """The reloaded drafter computes bit-identical features, logits and draft logits."""
    torch.manual_seed(7)
    features = torch.randn(2, 5, original.config.hidden_size)
    ids = torch.randint(0, original.config.vocab_size, (2, 5))
    positions = torch.arange(1, 6).expand(2, -1)
    with torch.no_grad():
        want_out, want_logits = original.step(features, ids, positions)
        got_out, got_logits = reloaded.step(features, ids, positions)
        assert torch.equal(got_out, want_out)
        assert torch.equal(got_logits, want_logits)
        want_draft = DraftHead(original).logits(want_out)
        assert torch.equal(DraftHead(reloaded).logits(got_out), want_draft)


def specforge_checkpoint(path: Path, *, vocab: int, draft_vocab: int, sglang_aux_ids: list[int],
                         hidden: int = 64, intermediate: int = 128, max_positions: int = 256,
                         config: dict | None = None, drop: tuple[str, ...] = (),
                         seed: int = 0) -> Path:
    """An EAGLE-3 checkpoint in SpecForge's layout for a tiny policy (4 heads of 16, 2 KV
    heads), written from its documented key names (not by fastdraft's exporter): an lm_head of
    its own over `draft_vocab` tokens with d2t/t2d, aux layers named as SGLang counts them (a
    layer's output) in eagle_config; `config` overrides keys, `drop` leaves tensors out."""
    gen = torch.Generator().manual_seed(seed)
    draft_ids = torch.randperm(vocab, generator=gen)[:draft_vocab]

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.1).to(torch.bfloat16)

    h, q, kv = hidden, 4 * 16, 2 * 16
    layer = {"input_layernorm.weight": 1 + rand(h), "hidden_norm.weight": 1 + rand(h),
             "post_attention_layernorm.weight": 1 + rand(h),
             "self_attn.q_proj.weight": rand(q, 2 * h), "self_attn.k_proj.weight": rand(kv, 2 * h),
             "self_attn.v_proj.weight": rand(kv, 2 * h), "self_attn.o_proj.weight": rand(h, q),
             "mlp.gate_proj.weight": rand(intermediate, h),
             "mlp.up_proj.weight": rand(intermediate, h),
             "mlp.down_proj.weight": rand(h, intermediate)}
    tensors = {"fc.weight": rand(h, 3 * h), "norm.weight": 1 + rand(h),
               "lm_head.weight": rand(draft_vocab, h),
               **{f"midlayer.{n}": t for n, t in layer.items()},
               "d2t": draft_ids - torch.arange(draft_vocab),
               "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, draft_ids, True)}
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
           "hidden_size": h, "intermediate_size": intermediate, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": vocab,
           "draft_vocab_size": draft_vocab, "max_position_embeddings": max_positions,
           "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
           "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_aux_ids},
           **(config or {})}
    path.mkdir(parents=True)
    save_file({n: t for n, t in tensors.items() if n not in drop},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return path
