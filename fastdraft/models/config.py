"""ModelConfig: the one description of a decoder that fastdraft runs, read from HF config.json.

Llama, Qwen2 and Qwen3 differ only in a few switches (biases, QK-norm); each family registers a
function that maps its HF config onto those switches, so the decoder itself has no family branches.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fastdraft.errors import FastdraftError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise FastdraftError(f"config.json: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise FastdraftError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise FastdraftError(f"config.json: rope type {rope_type!r} is not supported; "
                                 f"supported: {', '.join(ROPE_TYPES)}")

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        model_type = hf.get("model_type")
        if any(hf.get(key) for key in _EXPERT_KEYS) or "moe" in str(model_type):
            raise FastdraftError(f"config.json: {model_type!r} is a mixture-of-experts model; "
                                 "fastdraft runs dense decoders only (Qwen2 / Qwen2.5, Qwen3, "
                                 "Llama 3.x): choose a dense policy")
        if model_type not in FAMILIES:
            raise FastdraftError(f"config.json: model_type {model_type!r} is not supported; "
                                 f"supported: {', '.join(sorted(FAMILIES))}")
        num_heads = hf["num_attention_heads"]
        rope_theta, rope_scaling = _read_rope(hf)
        eos = hf.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
            hf_config=dict(hf),
            **FAMILIES[model_type](hf),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: point at an HF checkpoint directory "
                                    "(config.json + *.safetensors)")
        try:
            hf = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise FastdraftError(f"{path} is not valid JSON ({err}): copy it from the checkpoint "
                                 "again") from None
        return cls.from_hf_dict(hf)

    def to_hf_dict(self) -> dict[str, Any]:
        """HF config.json contents; keeps every key the checkpoint had (generation ids, dtype)."""
        out = dict(self.hf_config)
        plain = asdict(self)
        for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
                    "bos_token_id"):
            out[key] = plain[key]
        out["rope_theta"] = self.rope_theta
        out["rope_scaling"] = self.rope_scaling
        out.pop("rope_parameters", None)
        if self.eos_token_ids:
            ids = list(self.eos_token_ids)
            out["eos_token_id"] = ids[0] if len(ids) == 1 else ids
        out["architectures"] = [ARCHITECTURES[self.model_type]]
        return out


def _read_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Both spellings: transformers >= 5 writes `rope_parameters`; checkpoints in the wild have
    `rope_theta` + `rope_scaling` (with `type` as an old alias of `rope_type`)."""
    params = dict(hf.get("rope_parameters") or {})
    theta = params.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
    scaling = dict(hf.get("rope_scaling") or params or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling


# A mixture-of-experts config names its experts by one of these (Qwen2-/Qwen3-MoE, Mixtral,
# DeepSeek, Llama 4).
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")

FamilyReader = Callable[[dict[str, Any]], dict[str, bool]]
FAMILIES: dict[str, FamilyReader] = {}
ARCHITECTURES: dict[str, str] = {}


def register_family(model_type: str, architecture: str) -> Callable[[FamilyReader], FamilyReader]:
    def wrap(reader: FamilyReader) -> FamilyReader:
        FAMILIES[model_type] = reader
        ARCHITECTURES[model_type] = architecture
        return reader
    return wrap


@register_family("llama", "LlamaForCausalLM")
def _llama(hf: dict[str, Any]) -> dict[str, bool]:
    bias = bool(hf.get("attention_bias", False))
    return dict(qkv_bias=bias, o_proj_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)))


@register_family("qwen2", "Qwen2ForCausalLM")
def _qwen2(hf: dict[str, Any]) -> dict[str, bool]:
    if hf.get("use_sliding_window"):
        raise FastdraftError("config.json: Qwen2 sliding-window attention is not supported; "
                             "set use_sliding_window to false")
    return dict(qkv_bias=True)


@register_family("qwen3", "Qwen3ForCausalLM")
def _qwen3(hf: dict[str, Any]) -> dict[str, bool]:
    if hf.get("use_sliding_window"):
        raise FastdraftError("config.json: Qwen3 sliding-window attention is not supported; "
                             "set use_sliding_window to false")
    bias = bool(hf.get("attention_bias", False))
    return dict(qkv_bias=bias, o_proj_bias=bias, qk_norm=True)
