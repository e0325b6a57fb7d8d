"""config.json of an exported drafter: the target's shape (the drafter layer is a decoder layer
of the target's width and attention layout, run with the target's rope) with one layer, plus the
switches each engine class reads."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from fastdraft.export.formats import (
    EAGLE3_ARCHITECTURE,
    EXPORT_DTYPE_NAME,
    SGLANG_EAGLE1_ARCHITECTURES,
    VLLM_EAGLE1_ARCHITECTURE,
)
from fastdraft.models import ModelConfig


def target_shape(policy: ModelConfig) -> dict[str, Any]:
    """What every variant copies from the target."""
    return {
        "hidden_size": policy.hidden_size,
        "intermediate_size": policy.intermediate_size,
        "num_attention_heads": policy.num_attention_heads,
        "num_key_value_heads": policy.num_key_value_heads,
        "head_dim": policy.head_dim,
        "hidden_act": "silu",  # fastdraft's MLP is SwiGLU; the engines read this key
        "rms_norm_eps": policy.rms_norm_eps,
        "rope_theta": policy.rope_theta,
        "rope_scaling": policy.rope_scaling,
        "max_position_embeddings": policy.max_position_embeddings,
        "vocab_size": policy.vocab_size,
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "torch_dtype": EXPORT_DTYPE_NAME,
    }


def _has_bias(tensor_names: Collection[str], projection: str) -> bool:
    return any(n.endswith(f"self_attn.{projection}.bias") for n in tensor_names)


def bias_switches(architecture: str, tensor_names: Collection[str]) -> dict[str, bool]:
    """The config keys that make the engine build exactly the biases the export carries (a bias
    the config does not announce is an unexpected key; one it announces but lacks keeps a random
    init)."""
    qkv, o_proj = _has_bias(tensor_names, "q_proj"), _has_bias(tensor_names, "o_proj")
    if architecture == VLLM_EAGLE1_ARCHITECTURE:
        # vLLM: attention_bias sets o_proj's bias, qkv_bias (when present) overrides q/k/v's.
        return {"attention_bias": o_proj, "qkv_bias": qkv, "mlp_bias": False}
    if architecture == EAGLE3_ARCHITECTURE:
        return {"attention_bias": False, "mlp_bias": False}
    if architecture == SGLANG_EAGLE1_ARCHITECTURES["llama"]:
        # SGLang's Llama layer: one attention_bias switch for q, k, v and o.
        return {"attention_bias": qkv or o_proj, "mlp_bias": False}
    return {}  # Qwen2: q/k/v biases are part of the architecture


def engine_config(policy: ModelConfig, architecture: str, tensor_names: Collection[str],
                  draft_vocab_size: int | None = None,
                  sglang_aux_ids: list[int] | None = None) -> dict[str, Any]:
    """config.json for one exported directory. `draft_vocab_size` (EAGLE-3 only) is written
    explicitly, null meaning the whole vocabulary: SGLang reads the key with no default.
    `sglang_aux_ids` (EAGLE-3 aux layers other than the default capture, in SGLang's count:
    a layer's output) go into eagle_config, which only SGLang reads that way."""
    model_type = "qwen2" if architecture == SGLANG_EAGLE1_ARCHITECTURES["qwen2"] else "llama"
    config: dict[str, Any] = {"architectures": [architecture], "model_type": model_type,
                              **target_shape(policy),
                              **bias_switches(architecture, tensor_names)}
    if architecture == EAGLE3_ARCHITECTURE:
        config["draft_vocab_size"] = draft_vocab_size
        if sglang_aux_ids is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": sglang_aux_ids}
    return config
