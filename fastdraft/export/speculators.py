"""The speculators layout of an EAGLE-3 drafter (vLLM's own drafter format: what `vllm serve DIR`
and `speculative_config={"model": DIR}` read), written from and read back into the SGLang
layout this package builds and checks (docs/export-formats.md).

A speculators directory holds the same tensors with the decoder layer under `layers.0.` (not
`midlayer.`), and a config.json that wraps the drafter layer's Llama config
(`transformer_layer_config`) with the EAGLE-3 switches vLLM reads (vLLM's
transformers_utils/configs/speculators): `draft_vocab_size`, `target_hidden_size`,
`norm_before_residual` (vLLM's default is true; fastdraft's layer keeps the raw fc features as
its residual, so it is always written false), `eagle_aux_hidden_state_layer_ids` (counted as
vLLM counts them: layer i's input, as fastdraft does), and `speculators_config` (the algorithm,
the proposal method with its number of speculative tokens, and the verifier policy)."""

from __future__ import annotations

from typing import Any

import torch

from fastdraft.export.formats import EAGLE3_ARCHITECTURE
from fastdraft.models import ModelConfig

SPECULATORS_VERSION = "0.3.0"
LAYER_NAMES = ("midlayer.", "layers.0.")
_VERIFIER_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM"}
# SGLang-layout keys with no place in the drafter layer's own config.
_NOT_LAYER_KEYS = ("architectures", "draft_vocab_size", "eagle_config")


def speculators_config(sglang_config: dict[str, Any], policy: ModelConfig,
                       aux_layers: tuple[int, ...], verifier: str,
                       speculative_tokens: int) -> dict[str, Any]:
    """config.json of the speculators directory for the drafter whose SGLang-layout config is
    `sglang_config`; aux_layers in vLLM's (and fastdraft's) count."""
    layer = {k: v for k, v in sglang_config.items() if k not in _NOT_LAYER_KEYS}
    layer["architectures"] = ["LlamaForCausalLM"]
    draft_vocab = sglang_config.get("draft_vocab_size") or policy.vocab_size
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "torch_dtype": sglang_config.get("torch_dtype"),
        "transformer_layer_config": layer,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": policy.hidden_size,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": list(aux_layers),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier,
                         "architectures": [_VERIFIER_ARCHITECTURES.get(policy.model_type,
                                                                       "LlamaForCausalLM")]},
        },
    }


def as_sglang_config(config: dict[str, Any]) -> dict[str, Any]:
    """The SGLang-layout config.json equivalent to a speculators one (what the EAGLE-3 rules
    check, and what an import reads): the layer config with the EAGLE-3 keys put back."""
    layer = dict(config.get("transformer_layer_config") or {})
    vocab, draft_vocab = layer.get("vocab_size"), config.get("draft_vocab_size")
    layer.update(architectures=[EAGLE3_ARCHITECTURE],
                 draft_vocab_size=None if draft_vocab == vocab else draft_vocab)
    if config.get("torch_dtype") is not None:
        layer.setdefault("torch_dtype", config["torch_dtype"])
    return layer


def speculators_problems(config: dict[str, Any], num_layers: int | None = None) -> list[str]:
    """What in a speculators config.json vLLM would refuse, or read as another drafter than
    fastdraft's EAGLE-3 (num_layers: the policy's, to check the aux layer ids' range)."""
    problems = []
    if config.get("speculators_model_type") != "eagle3":
        problems.append(f"speculators_model_type is {config.get('speculators_model_type')!r}; "
                        "fastdraft reads and writes 'eagle3'")
    spec = config.get("speculators_config")
    try:
        tokens = spec["proposal_methods"][0]["speculative_tokens"]
        _ = spec["verifier"]["name_or_path"]
        if not isinstance(tokens, int) or tokens < 1:
            problems.append(f"speculative_tokens is {tokens!r}, must be a positive integer")
    except (KeyError, IndexError, TypeError):
        problems.append("speculators_config needs proposal_methods[0].speculative_tokens and "
                        "verifier.name_or_path (vLLM reads both)")
    if not isinstance(config.get("transformer_layer_config"), dict):
        problems.append("transformer_layer_config (the drafter layer's config) is missing")
    if config.get("norm_before_residual", True) is not False:
        problems.append("norm_before_residual is not false (vLLM's default is true): the "
                        "layer's residual would be the normed features, fastdraft's drafter "
                        "adds its attention to the raw ones")
    layer = config.get("transformer_layer_config") or {}
    if config.get("target_hidden_size", layer.get("hidden_size")) != layer.get("hidden_size"):
        problems.append(f"target_hidden_size {config.get('target_hidden_size')} differs from "
                        f"the layer's hidden_size {layer.get('hidden_size')}")
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None and not (isinstance(ids, list) and len(ids) == 3 and all(
            isinstance(i, int) and 0 <= i < (num_layers or i + 1) for i in ids)):
        problems.append(f"eagle_aux_hidden_state_layer_ids is {ids!r}: three layer ids in "
                        f"[0, {num_layers or 'num_layers'})")
    return problems


def rename_layer(tensors: dict[str, torch.Tensor], to_speculators: bool
                 ) -> dict[str, torch.Tensor]:
    """midlayer.* <-> layers.0.*; every other name is the same in both layouts."""
    old, new = LAYER_NAMES if to_speculators else LAYER_NAMES[::-1]
    return {(new + n[len(old):] if n.startswith(old) else n): t for n, t in tensors.items()}
