"""What SGLang 0.5.23 and vLLM 0.33.0 load as an EAGLE drafter (docs/export-formats.md), as
data: the config.json each class needs and the exact tensors (names, shapes, dtypes) it reads
given that config. Written from the engines' rules, not from the exporter's name table, so that
checking an export against them catches the exporter's own mistakes."""

from __future__ import annotations

from numbers import Real
from typing import Any

from fastdraft.export.formats import (
    EAGLE3_ARCHITECTURE,
    EXPORT_DTYPE_NAME,
    SGLANG_EAGLE1_ARCHITECTURES,
    VLLM_EAGLE1_ARCHITECTURE,
    Engine,
)

Shape = tuple[int, ...]
# name -> (shape, "float" | "int64" | "bool")
TensorRules = dict[str, tuple[Shape, str]]

SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "max_position_embeddings")
OTHER_KEYS = ("rms_norm_eps", "rope_theta", "rope_scaling")

def architectures_allowed(kind: str, engine: Engine) -> tuple[str, ...]:
    if kind == "eagle3":
        return (EAGLE3_ARCHITECTURE,)
    if engine == "sglang":  # one class may serve several target families
        return tuple(dict.fromkeys(SGLANG_EAGLE1_ARCHITECTURES.values()))
    return (VLLM_EAGLE1_ARCHITECTURE,)


def _truthy(config: dict[str, Any], *keys: str) -> bool:
    return any(bool(config.get(k)) for k in keys)


def config_problems(config: dict[str, Any], kind: str, engine: Engine) -> list[str]:
    """Everything in config.json that would make `engine` refuse the directory, build a
    different drafter than the one exported, or read the wrong shapes."""
    problems = []
    archs = config.get("architectures")
    allowed = architectures_allowed(kind, engine)
    if not (isinstance(archs, list) and len(archs) == 1 and archs[0] in allowed):
        problems.append(f"architectures is {archs!r}; {engine} loads this drafter kind "
                        f"({kind}) only as {' or '.join(repr([a]) for a in allowed)}")
    arch = archs[0] if isinstance(archs, list) and archs else None
    model_type = "qwen2" if arch == SGLANG_EAGLE1_ARCHITECTURES["qwen2"] else "llama"
    if config.get("model_type") != model_type:
        problems.append(f"model_type is {config.get('model_type')!r}, {arch} needs "
                        f"{model_type!r}")
    if config.get("num_hidden_layers") != 1:
        problems.append(f"num_hidden_layers is {config.get('num_hidden_layers')!r}, must be 1")
    for key in SHAPE_KEYS:
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"{key} must be a positive integer, got {value!r}")
    for key in OTHER_KEYS:
        if key not in config:
            problems.append(f"{key} is missing (the drafter must run with the target's)")
    for key in ("rms_norm_eps", "rope_theta"):
        if key in config and not (isinstance(config[key], Real) and config[key] > 0):
            problems.append(f"{key} must be a positive number, got {config[key]!r}")
    if not problems and config["num_attention_heads"] % config["num_key_value_heads"]:
        problems.append("num_attention_heads is not a multiple of num_key_value_heads")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act is {config['hidden_act']!r}; the drafter's MLP is SwiGLU "
                        "(silu)")
    if _truthy(config, "mlp_bias") and (kind == "eagle3" or engine == "sglang"):
        problems.append("mlp_bias is set but SGLang's EAGLE MLP has no bias")
    if kind == "eagle3":
        problems += _eagle3_config_problems(config, engine)
    return problems


def _eagle3_config_problems(config: dict[str, Any], engine: Engine) -> list[str]:
    problems = []
    if "draft_vocab_size" not in config:
        problems.append("draft_vocab_size is missing: SGLang reads it with no default (write "
                        "null for the whole vocabulary)")
    else:
        draft_vocab, vocab = config["draft_vocab_size"], config.get("vocab_size")
        if draft_vocab is not None and not (
                isinstance(draft_vocab, int) and isinstance(vocab, int)
                and 1 <= draft_vocab <= vocab):
            problems.append(f"draft_vocab_size must be null or in [1, vocab_size={vocab}], "
                            f"got {draft_vocab!r}")
    if config.get("tie_word_embeddings") is not False:
        problems.append("tie_word_embeddings must be false: tied, SGLang uses the embedding as "
                        "the draft lm_head and ignores lm_head.weight")
    if config.get("torch_dtype") != EXPORT_DTYPE_NAME:
        problems.append(f"torch_dtype is {config.get('torch_dtype')!r}, must be "
                        f"{EXPORT_DTYPE_NAME!r}")
    if "eagle_config" in config and engine == "vllm":
        problems.append("eagle_config must be left out of a directory vLLM loads: SGLang and "
                        "vLLM read its aux layer ids one apart (vLLM gets the speculators "
                        "layout, which names them as it counts)")
    elif "eagle_config" in config:
        ids = (config["eagle_config"] or {}).get("eagle_aux_hidden_state_layer_ids")
        if not (isinstance(ids, list) and len(ids) == 3
                and all(isinstance(i, int) and i >= 0 for i in ids)):
            problems.append(f"eagle_config.eagle_aux_hidden_state_layer_ids is {ids!r}: three "
                            "layer ids (SGLang's count: a layer's output)")
    if _truthy(config, "attention_bias", "bias", "qkv_bias"):
        problems.append("attention biases are switched on, but SGLang's EAGLE-3 q/k/v "
                        "projections have none, so the directory cannot serve both engines")
    return problems


def _attention_biases(config: dict[str, Any], kind: str, arch: str) -> tuple[str, ...]:
    """The attention projections whose bias the engine class builds from this config."""
    if kind == "eagle3":
        return ()
    if arch == SGLANG_EAGLE1_ARCHITECTURES["qwen2"]:
        return ("q_proj", "k_proj", "v_proj")
    attention_bias = _truthy(config, "attention_bias", "bias")
    if arch == VLLM_EAGLE1_ARCHITECTURE:
        qkv = bool(config["qkv_bias"]) if "qkv_bias" in config else attention_bias
        return (("q_proj", "k_proj", "v_proj") if qkv else ()) + (
            ("o_proj",) if attention_bias else ())
    return ("q_proj", "k_proj", "v_proj", "o_proj") if attention_bias else ()


def expected_tensors(config: dict[str, Any], kind: str, engine: Engine) -> TensorRules:
    """Exactly the tensors the engine reads (every one must be there, nothing else may be),
    for a config.json that passed `config_problems`."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    q_size, kv_size = heads * config["head_dim"], kv_heads * config["head_dim"]
    arch = config["architectures"][0]
    prefix = "midlayer." if kind == "eagle3" else "layers.0."
    attn_in = 2 * h if kind == "eagle3" else h
    rules: TensorRules = {
        "fc.weight": ((h, (3 if kind == "eagle3" else 2) * h), "float"),
        f"{prefix}self_attn.q_proj.weight": ((q_size, attn_in), "float"),
        f"{prefix}self_attn.k_proj.weight": ((kv_size, attn_in), "float"),
        f"{prefix}self_attn.v_proj.weight": ((kv_size, attn_in), "float"),
        f"{prefix}self_attn.o_proj.weight": ((h, q_size), "float"),
        f"{prefix}mlp.gate_proj.weight": ((inter, h), "float"),
        f"{prefix}mlp.up_proj.weight": ((inter, h), "float"),
        f"{prefix}mlp.down_proj.weight": ((h, inter), "float"),
        f"{prefix}post_attention_layernorm.weight": ((h,), "float"),
    }
    bias_sizes = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size, "o_proj": h}
    for proj in _attention_biases(config, kind, arch):
        rules[f"{prefix}self_attn.{proj}.bias"] = ((bias_sizes[proj],), "float")
    if engine == "vllm" and kind == "eagle1" and _truthy(config, "mlp_bias"):
        rules.update({f"{prefix}mlp.gate_proj.bias": ((inter,), "float"),
                      f"{prefix}mlp.up_proj.bias": ((inter,), "float"),
                      f"{prefix}mlp.down_proj.bias": ((h,), "float")})
    if kind == "eagle1" and engine == "sglang":
        # SGLang's fc always has a bias: without one in the file it keeps a random init.
        rules["fc.bias"] = ((h,), "float")
    if kind == "eagle3":
        vocab = config["vocab_size"]
        draft_vocab = config.get("draft_vocab_size") or vocab
        rules.update({
            f"{prefix}input_layernorm.weight": ((h,), "float"),
            f"{prefix}hidden_norm.weight": ((h,), "float"),
            "norm.weight": ((h,), "float"),
            "lm_head.weight": ((draft_vocab, h), "float"),
        })
        if draft_vocab < vocab:
            rules["d2t"] = ((draft_vocab,), "int64")
            rules["t2d"] = ((vocab,), "bool")
    return rules


def why_unexpected(name: str, kind: str, engine: Engine) -> str:
    """The reason an extra tensor breaks loading, for the error message."""
    if "embed_tokens" in name:
        return "the engines take embed_tokens from the target"
    if name in ("d2t", "t2d"):
        return "d2t/t2d belong only to an EAGLE-3 export with draft_vocab_size < vocab_size"
    if kind == "eagle3":
        return "neither engine's EAGLE-3 class has it; vLLM's loader raises on unexpected keys"
    if name.endswith("input_layernorm.weight"):
        return "the EAGLE-1 layer has no input_layernorm"
    if name == "norm.weight":
        return "the EAGLE-1 drafter has no final norm"
    if name.startswith("lm_head"):
        return "EAGLE-1 drafters use the target's lm_head"
    if name == "fc.bias":
        return "vLLM's EAGLE-1 fc has no bias"
    if engine == "vllm":
        return "vLLM's loader raises on unexpected keys"
    return "SGLang's drafter class has no such parameter"


def why_required(name: str) -> str:
    """What goes wrong when a tensor the engine reads is not in the file."""
    if name in ("d2t", "t2d"):
        return ("draft_vocab_size < vocab_size, and without d2t/t2d an engine puts draft "
                "logits on the wrong tokens")
    if name == "fc.bias":
        return "SGLang's fc always has a bias and keeps a random init without one"
    return "the engine would keep a random init"
