"""What an export is made of: the formats a caller asks for, the engine architectures each
drafter kind becomes, and where each variant's directory goes.

EAGLE-1 needs one directory per engine (SGLang wants `fc.bias` and an `...Eagle` architecture,
vLLM refuses both); EAGLE-3 has the SpecForge/SGLang directory (both engines load it) and the
speculators one (vLLM's own format)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from fastdraft.errors import FastdraftError

ExportFormat = Literal["sglang", "vllm", "speculators", "all", "both"]
Engine = Literal["sglang", "vllm"]
Layout = Literal["sglang", "vllm", "speculators"]

FORMATS: tuple[str, ...] = ("sglang", "vllm", "speculators", "all", "both")
ENGINES: tuple[Engine, ...] = ("sglang", "vllm")
KINDS: tuple[str, ...] = ("eagle1", "eagle3")
# The directories each kind exports to (out/<layout>): EAGLE-1 one per engine; EAGLE-3 the
# SpecForge/SGLang layout (LlamaForCausalLMEagle3, which vLLM loads too) and the speculators
# layout (vLLM's own format, which `vllm serve DIR` reads the verifier and depth from).
LAYOUTS: dict[str, tuple[Layout, ...]] = {"eagle1": ("sglang", "vllm"),
                                          "eagle3": ("sglang", "speculators")}

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


def layouts_for(kind: str, fmt: str) -> tuple[Layout, ...]:
    """The layouts a format asks for: "all" (or "both") every layout of the kind; "vllm" for an
    EAGLE-3 drafter is vLLM's own format, speculators."""
    check_kind(kind)
    if fmt not in FORMATS:
        raise FastdraftError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt in ("all", "both"):
        return LAYOUTS[kind]
    if kind == "eagle3" and fmt == "vllm":
        return ("speculators",)
    if fmt not in LAYOUTS[kind]:
        raise FastdraftError(f"an {kind} drafter exports as {', '.join(LAYOUTS[kind])} (or all); "
                             f"fastdraft writes the {fmt} layout for EAGLE-3 drafters only")
    return (fmt,)  # type: ignore[return-value]


def engines_for(fmt: str) -> tuple[Engine, ...]:
    """The engines an EAGLE-1 check names; "all" is every engine."""
    if fmt not in ("sglang", "vllm", "all"):
        raise FastdraftError(f"unknown engine {fmt!r}; choose one of sglang, vllm, all")
    return ENGINES if fmt == "all" else (fmt,)  # type: ignore[return-value]


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise FastdraftError(f"unknown drafter kind {kind!r}; export supports {', '.join(KINDS)}")


def export_dirs(out_dir: str | Path, kind: str, fmt: str) -> dict[Path, Layout]:
    """Each directory `export_drafter` writes (out/<layout>), with its layout."""
    return {Path(out_dir) / layout: layout for layout in layouts_for(kind, fmt)}


def layout_engines(kind: str, layout: Layout, default_aux: bool = True) -> tuple[Engine, ...]:
    """The engines that load a layout's directory: an EAGLE-3 SGLang-layout directory serves
    vLLM too unless it names its aux layers (the engines count them one apart)."""
    if layout == "speculators":
        return ("vllm",)
    if kind == "eagle3":
        return ENGINES if default_aux else ("sglang",)
    return (layout,)  # type: ignore[return-value]


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
