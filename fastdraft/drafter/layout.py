"""The drafter's own decoder-layer switches (attention biases, MLP bias, QK-norm).

A drafter layer has the target's shapes (width, heads, rope) but not necessarily the target's
switches: SGLang and vLLM load a drafter into their own EAGLE layer classes (docs/export-formats.md,
export/rules.py), which are Llama layers without QK-norm and, for EAGLE-3, without any bias. A
drafter that copied a Qwen3 target's QK-norm or a Qwen2 target's q/k/v bias into its EAGLE-3 layer
would train and run in fastdraft and then never leave it. So each drafter kind derives its layer
layout from the target (Drafter.layer_layout) and checkpoints record the layout they were built
with: drafters saved before that copied the target's switches, and still load as they were."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from fastdraft.errors import FastdraftError
from fastdraft.models import ModelConfig

# drafter_config.json key holding the layout (absent in checkpoints saved before it existed).
LAYOUT_KEY = "layer_layout"

_DESCRIPTIONS = {"qkv_bias": "q/k/v bias", "o_proj_bias": "o_proj bias",
                 "mlp_bias": "MLP bias", "qk_norm": "QK-norm"}


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerLayout:
    """The ModelConfig switches of the drafter's decoder layer; everything else is the target's."""

    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            if not isinstance(getattr(self, f.name), bool):
                raise FastdraftError(f"drafter layer layout: {f.name} must be true or false, got "
                                     f"{getattr(self, f.name)!r}")

    @classmethod
    def of(cls, cfg: ModelConfig) -> LayerLayout:
        """The switches `cfg`'s own layers have (a target's, or a legacy drafter's)."""
        return cls(**{f.name: bool(getattr(cfg, f.name)) for f in fields(cls)})

    @classmethod
    def from_dict(cls, saved: Any) -> LayerLayout:
        names = {f.name for f in fields(cls)}
        if not isinstance(saved, dict) or set(saved) != names:
            raise FastdraftError(f"drafter_config.json: {LAYOUT_KEY} must map exactly "
                                 f"{sorted(names)} to true/false, got {saved!r}")
        return cls(**saved)

    def to_dict(self) -> dict[str, bool]:
        return asdict(self)

    def apply(self, target: ModelConfig) -> ModelConfig:
        """The config the drafter's layer is built from: the target's, these switches set."""
        return replace(target, **self.to_dict())

    def describe(self) -> str:
        """'q/k/v bias, QK-norm' or 'no bias, no QK-norm', for messages."""
        parts = [_DESCRIPTIONS[name] for name, on in self.to_dict().items() if on]
        return ", ".join(parts) if parts else "no bias, no QK-norm"

    def differences(self, wanted: LayerLayout) -> list[str]:
        """'has QK-norm' / 'lacks q/k/v bias' for every switch that differs from `wanted`."""
        return [f"{'has' if on else 'lacks'} {_DESCRIPTIONS[name]}"
                for name, on in self.to_dict().items() if on != getattr(wanted, name)]


def saved_layout(meta: dict[str, Any]) -> LayerLayout:
    """The layout a drafter checkpoint was built with. Checkpoints without one were saved when the
    drafter layer was built from the target's config: they have the target's switches."""
    if LAYOUT_KEY in meta:
        return LayerLayout.from_dict(meta[LAYOUT_KEY])
    return LayerLayout.of(ModelConfig.from_hf_dict(meta["policy_config"]))
