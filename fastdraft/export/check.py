"""Re-reads an exported directory and checks it against what the engines load. Neither engine
runs on fastdraft's CPU machines, so this check is what stands between an export and an engine
that refuses it at start-up or, worse, loads it and drafts garbage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from fastdraft.errors import FastdraftError
from fastdraft.export.formats import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    Engine,
    check_kind,
    engines_for,
)
from fastdraft.export.rules import (
    SHAPE_KEYS,
    architectures_allowed,
    config_problems,
    expected_tensors,
    why_required,
    why_unexpected,
)
from fastdraft.export.speculators import as_sglang_config, rename_layer, speculators_problems
from fastdraft.export.vocab import vocab_problems
from fastdraft.utils.file_digest import check_sums

_KIND_NAMES = {"eagle1": "EAGLE-1", "eagle3": "EAGLE-3"}
_ENGINE_NAMES = {"sglang": "SGLang", "vllm": "vLLM"}
_INTEGRAL_DTYPES = {"int64": torch.int64, "bool": torch.bool}


def check_export(export_dir: str | Path, fmt: str, kind: str, *,
                 expected_draft_token_ids: torch.Tensor | None = None,
                 num_layers: int | None = None) -> None:
    """Checks one exported directory (the one an engine is pointed at, with config.json) for
    the engine(s) that load it; raises a FastdraftError listing every problem found.

    EAGLE-1 directories serve one engine each (fmt "sglang" or "vllm"). An EAGLE-3 directory in
    the SGLang layout must serve both engines unless it names its aux layers (eagle_config:
    SGLang only); one in the speculators layout (fmt "speculators", or a config.json with
    speculators_config) is vLLM's. `expected_draft_token_ids`, when given, must be what d2t
    reconstructs (EAGLE-1 exports carry no draft vocabulary, so it is ignored for them);
    num_layers (the policy's) bounds the speculators aux layer ids."""
    check_kind(kind)
    export_dir = Path(export_dir)
    config, tensors = _read_export(export_dir)
    problems: list[str] = []
    if kind == "eagle1":
        engines = engines_for(fmt)
        if len(engines) > 1:
            raise FastdraftError("no EAGLE-1 directory serves both engines (SGLang needs fc.bias, "
                                 "vLLM refuses it): check <out>/sglang with fmt='sglang' and "
                                 "<out>/vllm with fmt='vllm'")
    elif fmt == "speculators" or "speculators_config" in config:
        engines = ("vllm",)
        problems = speculators_problems(config, num_layers)
        config, tensors = as_sglang_config(config), rename_layer(tensors, to_speculators=False)
    else:
        engines = ("sglang",) if "eagle_config" in config else ("sglang", "vllm")
    for engine in engines:  # EAGLE-3's rules are the same for both: report each problem once
        found = _problems_for(config, tensors, kind, engine, expected_draft_token_ids)
        problems += [p for p in found if p not in problems]
    if problems:
        who = "SGLang and vLLM load" if len(engines) > 1 else f"{_ENGINE_NAMES[engines[0]]} loads"
        raise FastdraftError(f"{export_dir} is not an {_KIND_NAMES[kind]} drafter that {who} as "
                             f"exported: {'; '.join(problems)}")


def _read_export(export_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config_path, weights_path = export_dir / CONFIG_FILE, export_dir / WEIGHTS_FILE
    missing = [p.name for p in (config_path, weights_path) if not p.is_file()]
    if missing:
        raise FastdraftError(f"{export_dir} is not an exported drafter: {', '.join(missing)} "
                             "missing")
    check_sums(export_dir)   # raises CorruptFileError (a FastdraftError) naming a damaged file
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise FastdraftError(f"{config_path} is not valid JSON: {err}") from err
    if not isinstance(config, dict):
        raise FastdraftError(f"{config_path} must hold a JSON object")
    return config, load_file(str(weights_path))


def _readable(config: dict[str, Any], kind: str, engine: Engine) -> bool:
    """Whether the config says enough to derive the tensors the engine reads."""
    archs = config.get("architectures")
    return (isinstance(archs, list) and len(archs) == 1
            and archs[0] in architectures_allowed(kind, engine)
            and all(isinstance(config.get(k), int) and config[k] > 0 for k in SHAPE_KEYS)
            and (kind == "eagle1" or config.get("draft_vocab_size") is None
                 or isinstance(config["draft_vocab_size"], int)))


def _problems_for(config: dict[str, Any], tensors: dict[str, torch.Tensor], kind: str,
                  engine: Engine, expected_ids: torch.Tensor | None) -> list[str]:
    problems = config_problems(config, kind, engine)
    if not _readable(config, kind, engine):
        return problems
    rules = expected_tensors(config, kind, engine)
    for name in sorted(set(rules) - set(tensors)):
        problems.append(f"{name} is missing ({why_required(name)})")
    for name in sorted(set(tensors) - set(rules)):
        problems.append(f"{name} must not be there ({why_unexpected(name, kind, engine)})")
    for name in sorted(set(rules) & set(tensors)):
        (shape, dtype_kind), tensor = rules[name], tensors[name]
        if tuple(tensor.shape) != shape:
            problems.append(f"{name} has shape {list(tensor.shape)}, expected {list(shape)}")
        ok_dtype = (tensor.dtype.is_floating_point if dtype_kind == "float"
                    else tensor.dtype == _INTEGRAL_DTYPES[dtype_kind])
        if not ok_dtype:
            problems.append(f"{name} has dtype {tensor.dtype}, expected {dtype_kind}")
    if kind == "eagle3" and expected_ids is not None and "d2t" not in rules:
        problems.append(f"the drafter drafts {len(expected_ids)} tokens but draft_vocab_size "
                        "says the whole vocabulary")
    if "d2t" in rules and "d2t" in tensors and "t2d" in tensors and not any(
            p.startswith(("d2t ", "t2d ")) for p in problems):
        problems += vocab_problems(tensors["d2t"], tensors["t2d"], config["vocab_size"],
                                   expected_ids)
    return problems
