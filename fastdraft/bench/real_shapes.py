"""Real model shapes with random weights: the honest way to time a GPU engine without a model
download (speed depends on shapes, not on weight values). Shapes are HF config.json fields."""

from __future__ import annotations

from typing import Any

import torch

from fastdraft.drafter import Drafter, build_drafter
from fastdraft.errors import FastdraftError
from fastdraft.models import CausalLM, ModelConfig

_QWEN25 = dict(model_type="qwen2", vocab_size=152064, rms_norm_eps=1e-6, rope_theta=1e6,
               max_position_embeddings=32768, tie_word_embeddings=False)
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-7b": dict(_QWEN25, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4),
    "qwen2.5-1.5b": dict(_QWEN25, vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         tie_word_embeddings=True),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                         max_position_embeddings=131072, tie_word_embeddings=False),
}


def shape_config(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise FastdraftError(f"unknown shape {name!r}; choose one of {sorted(SHAPES)}")
    return ModelConfig.from_hf_dict(SHAPES[name])


def _randomise(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Matrices ~ N(0, 0.02) (HF's init); norms stay 1, biases 0."""
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02, generator=generator)


def random_policy(name: str, device: str, dtype: torch.dtype, max_positions: int,
                  seed: int = 0) -> CausalLM:
    cfg = shape_config(name)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # allocate in the target dtype directly (no fp32 copy)
    try:
        with torch.device(device):
            model = CausalLM(cfg, max_positions=max_positions)
    finally:
        torch.set_default_dtype(previous)
    _randomise(model, torch.Generator(device).manual_seed(seed))
    return model.eval()


def random_drafter(policy: CausalLM, kind: str, max_positions: int, seed: int = 1) -> Drafter:
    param = next(policy.parameters())
    drafter = build_drafter(kind, policy.config, max_positions).to(param.device, param.dtype)
    _randomise(drafter, torch.Generator(param.device).manual_seed(seed))
    return drafter.attach(policy).eval()
