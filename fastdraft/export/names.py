"""fastdraft drafter parameter names <-> the tensor names SGLang and vLLM load, and back.

fastdraft names its drafter modules after the EAGLE reference code (`fc`, `layers.0` for
EAGLE-1, `midlayer` and `norm` for EAGLE-3, HF projection names inside), so every mapped name is
spelled the same on both sides. The table is explicit anyway: a renamed or new drafter parameter
must stop the export with its name, not be dropped or written where no engine reads it.
"""

from __future__ import annotations

import torch

from fastdraft.errors import FastdraftError
from fastdraft.export.formats import (
    EAGLE3_ARCHITECTURE,
    SGLANG_EAGLE1_ARCHITECTURES,
    VLLM_EAGLE1_ARCHITECTURE,
    check_kind,
)

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
LAYER_PREFIX = {"eagle1": "layers.0.", "eagle3": "midlayer."}
OWN_HEAD = "head.weight"


def _decoder_layer_weights(prefix: str, norms: tuple[str, ...]) -> tuple[str, ...]:
    return (*(f"{prefix}self_attn.{p}.weight" for p in ATTENTION_PROJECTIONS),
            *(f"{prefix}mlp.{p}.weight" for p in MLP_PROJECTIONS),
            *(f"{prefix}{norm}.weight" for norm in norms))


# Every drafter of the kind has these. EAGLE-1's layer has no input_layernorm (the fc output is
# used as is); EAGLE-3's normalises the embedding (input_layernorm) and the features
# (hidden_norm) separately, and a final norm precedes the lm_head.
DRAFTER_WEIGHTS: dict[str, tuple[str, ...]] = {
    "eagle1": ("fc.weight", *_decoder_layer_weights("layers.0.", ("post_attention_layernorm",))),
    "eagle3": ("fc.weight",
               *_decoder_layer_weights("midlayer.", ("input_layernorm", "hidden_norm",
                                                     "post_attention_layernorm")),
               "norm.weight"),
}

# The attention biases each engine class can hold. SGLang's Llama layer has one switch for all
# four (attention_bias); its Qwen2 layer always has q/k/v biases and never an o_proj one; vLLM's
# Llama layer has separate switches (qkv_bias, attention_bias); SGLang's EAGLE-3 q/k/v projection
# has no bias at all, so an EAGLE-3 directory, which both engines read, carries none.
ATTENTION_BIASES: dict[str, tuple[str, ...]] = {
    SGLANG_EAGLE1_ARCHITECTURES["llama"]: ATTENTION_PROJECTIONS,
    SGLANG_EAGLE1_ARCHITECTURES["qwen2"]: ("q_proj", "k_proj", "v_proj"),
    VLLM_EAGLE1_ARCHITECTURE: ATTENTION_PROJECTIONS,
    EAGLE3_ARCHITECTURE: (),
}


def export_name_map(kind: str, architecture: str) -> dict[str, str]:
    """fastdraft name -> exported name, for every drafter tensor `architecture` can hold."""
    check_kind(kind)
    if architecture not in ATTENTION_BIASES:
        raise FastdraftError(f"unknown export architecture {architecture!r}; known: "
                             f"{', '.join(ATTENTION_BIASES)}")
    prefix = LAYER_PREFIX[kind]
    names = (*DRAFTER_WEIGHTS[kind],
             *(f"{prefix}self_attn.{p}.bias" for p in ATTENTION_BIASES[architecture]))
    mapping = {name: name for name in names}
    if kind == "eagle3":   # an imported drafter's own lm_head (Drafter.head)
        mapping[OWN_HEAD] = "lm_head.weight"
    return mapping


def _why_unmapped(name: str, kind: str, architecture: str) -> str:
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return "QK-norm (Qwen3) has no place in the engines' Llama/Qwen2 EAGLE layers"
    if ".mlp." in name and name.endswith(".bias"):
        return "the engines' EAGLE MLPs have no bias"
    if name.endswith(".bias") and kind == "eagle3":
        return ("SGLang's EAGLE-3 q/k/v projections have no bias, so the one directory both "
                "engines read cannot carry attention biases")
    if name.endswith(".bias"):
        return f"{architecture}'s attention has no such bias"
    return "no engine tensor corresponds to it"


def to_engine_names(kind: str, architecture: str, tensors: dict[str, torch.Tensor]
                    ) -> dict[str, torch.Tensor]:
    """Renames a drafter's trainable tensors for `architecture`; raises naming every tensor that
    has no place there (an export that silently lost weights would draft garbage)."""
    mapping = export_name_map(kind, architecture)
    unmapped = sorted(set(tensors) - set(mapping))
    if unmapped:
        reasons = "; ".join(f"{n}: {_why_unmapped(n, kind, architecture)}" for n in unmapped)
        raise FastdraftError(f"cannot export this {kind} drafter as {architecture}: "
                             f"{len(unmapped)} tensor(s) have no engine name ({reasons})")
    missing = [n for n in DRAFTER_WEIGHTS[kind] if n not in tensors]
    if missing:
        raise FastdraftError(f"the {kind} drafter lacks {missing[:3]}: not a complete checkpoint")
    return {mapping[name]: tensor for name, tensor in tensors.items()}


def from_engine_names(kind: str, architecture: str, tensors: dict[str, torch.Tensor]
                      ) -> dict[str, torch.Tensor]:
    """The inverse of `to_engine_names`, for the drafter tensors of an exported directory (the
    engine-only tensors fc.bias, lm_head, d2t and t2d are the caller's to handle first)."""
    inverse = {exported: name for name, exported in export_name_map(kind, architecture).items()}
    unknown = sorted(set(tensors) - set(inverse))
    if unknown:
        raise FastdraftError(f"{architecture} export has tensors no {kind} drafter holds: "
                             f"{unknown}")
    return {inverse[name]: tensor for name, tensor in tensors.items()}
