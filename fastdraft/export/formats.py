"""What an export is made of: the formats a caller asks for, the engine architectures each
drafter kind becomes, and where each variant's directory goes.

EAGLE-1 needs one directory per engine (SGLang wants `fc.bias` and an `...Eagle` architecture,
vLLM refuses both); EAGLE-3 has one directory that both engines load."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from fastdraft.errors import FastdraftError

ExportFormat = Literal["sglang", "vllm", "all"]
Engine = Literal["sglang", "vllm"]

FORMATS: tuple[str, ...] = ("sglang", "vllm", "all")
ENGINES: tuple[Engine, ...] = ("sglang", "vllm")
KINDS: tuple[str, ...] = ("eagle1", "eagle3")

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# Both engines run drafters in bfloat16; the weights are written in it too (see writer.py).
EXPORT_DTYPE_NAME = "bfloat16"

# SGLang's EAGLE-1 drafter class for each target family. SGLang has no Qwen3 EAGLE-1 class; a
# Qwen3 target's drafter has no QK-norm (drafter/eagle1.py), so it is a Llama EAGLE layer.
SGLANG_EAGLE1_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLMEagle",
    "qwen2": "Qwen2ForCausalLMEagle",
    "qwen3": "LlamaForCausalLMEagle",
}
# vLLM prefixes "Eagle" itself and does not know LlamaForCausalLMEagle.
VLLM_EAGLE1_ARCHITECTURE = "LlamaForCausalLM"
# One class for every target family, in both engines.
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


def engines_for(fmt: str) -> tuple[Engine, ...]:
    """The engines a format asks for; "all" is every engine."""
    if fmt not in FORMATS:
        raise FastdraftError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return ENGINES if fmt == "all" else (fmt,)  # type: ignore[return-value]


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise FastdraftError(f"unknown drafter kind {kind!r}; export supports {', '.join(KINDS)}")


def export_dirs(out_dir: str | Path, kind: str, fmt: str) -> dict[Path, tuple[Engine, ...]]:
    """Each directory `export_drafter` writes, with the engines that load it: EAGLE-1 gets
    `out/sglang` and/or `out/vllm`; EAGLE-3 writes `out` itself, loaded by every engine."""
    check_kind(kind)
    engines = engines_for(fmt)
    out_dir = Path(out_dir)
    if kind == "eagle3":
        return {out_dir: ENGINES}
    return {out_dir / engine: (engine,) for engine in engines}


def sglang_eagle1_architecture(model_type: str) -> str:
    if model_type not in SGLANG_EAGLE1_ARCHITECTURES:
        raise FastdraftError(f"SGLang has no EAGLE-1 drafter class for {model_type!r} targets; "
                             f"fastdraft exports EAGLE-1 drafters for "
                             f"{', '.join(SGLANG_EAGLE1_ARCHITECTURES)} targets")
    return SGLANG_EAGLE1_ARCHITECTURES[model_type]


def architecture_for(kind: str, engine: Engine, model_type: str) -> str:
    """The `architectures` entry of the directory `engine` loads for a drafter of `kind`."""
    check_kind(kind)
    if kind == "eagle3":
        return EAGLE3_ARCHITECTURE
    if engine == "sglang":
        return sglang_eagle1_architecture(model_type)
    return VLLM_EAGLE1_ARCHITECTURE
