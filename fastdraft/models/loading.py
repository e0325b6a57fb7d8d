"""HF checkpoint directories in and out: config.json + *.safetensors (sharded index included)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from fastdraft.errors import FastdraftError
from fastdraft.models.config import ModelConfig
from fastdraft.models.decoder import CausalLM
from fastdraft.models.tensor_parallel import TPRank
from fastdraft.utils.atomic import atomic_dir
from fastdraft.utils.tensor_file import (
    check_safetensors,
    check_tensor_headers,
    save_tensors,
    tensor_headers,
)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "generation_config.json", "vocab.json", "merges.txt")


def weight_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's *.safetensors files (the index file decides the shards when present),
    each there and whole as its header tells (a truncated file is named, not loaded)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / s for s in shards]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}: fastdraft loads HF checkpoints "
                                "saved with safe_serialization (the default)")
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"{path} is listed in {index.name} but missing")
        check_safetensors(path, f"checkpoint {model_dir}")
    return files


def check_weight_headers(model_dir: str | Path, cfg: ModelConfig, setting: str) -> None:
    """Every weight the config's model needs is in the checkpoint's files, of its shape and a
    float dtype, read from the headers (nothing loaded): what load_model would refuse (or cast
    silently), told before any work."""
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in weight_files(model_dir):
        found.update(tensor_headers(path))
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    tied = frozenset({"lm_head.weight"} if cfg.tie_word_embeddings else ())
    check_tensor_headers(found, expected, f"{setting} {model_dir}", optional=tied)


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) over every shard of weight_files(model_dir)."""
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is no dict)
                yield name, f.get_tensor(name)


def load_named_tensors(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]],
                       strict: bool = True) -> list[str]:
    """Copies tensors into the model's parameters in place (same storage: CUDA graphs and the
    engine keep working). Returns the names loaded; unknown names or wrong shapes raise."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = []
    with torch.no_grad():
        for name, tensor in named:
            if name not in params:
                if strict:
                    raise FastdraftError(f"weight {name!r} does not belong to this "
                                         f"{type(model).__name__}; expected names like "
                                         f"{next(iter(params))!r}")
                continue
            param = params[name]
            if param.shape != tensor.shape:
                raise FastdraftError(f"weight {name!r} has shape {tuple(tensor.shape)}, the model "
                                     f"expects {tuple(param.shape)}")
            param.copy_(tensor)
            loaded.append(name)
    return loaded


def load_model(model_dir: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, max_positions: int | None = None,
               tp: TPRank | None = None) -> CausalLM:
    """tp: this rank's slice of a tensor-parallel replica (each tensor sliced as it is read)."""
    cfg = ModelConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions, tp)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    # Rotary tables are buffers computed at init: rebuild them on the real device.
    model.rope = type(model.rope)(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                  cfg.max_position_embeddings,
                                  max_positions or cfg.max_position_embeddings).to(device)
    named = model.local_tensors(_skip_tied(iter_safetensors(model_dir), cfg))
    loaded = set(load_named_tensors(model, named))
    expected = {n for n, _ in model.named_parameters()}
    missing = expected - loaded - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    if missing:
        raise FastdraftError(f"checkpoint {model_dir} lacks {len(missing)} weights, e.g. "
                             f"{sorted(missing)[:3]}")
    return model.eval()


def _skip_tied(named: Iterator[tuple[str, torch.Tensor]], cfg: ModelConfig
               ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in named:
        if not (cfg.tie_word_embeddings and name == "lm_head.weight"):
            yield name, tensor


def save_model(model: CausalLM, out_dir: str | Path, tokenizer_dir: str | Path | None = None
               ) -> None:
    """Writes an HF checkpoint directory atomically (temp dir + rename): a killed process never
    leaves a half-written model where a complete one is expected."""
    with atomic_dir(out_dir, kind="policy") as tmp:
        tensors = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters()}
        save_tensors(tensors, str(tmp / "model.safetensors"))
        hf = model.config.to_hf_dict()
        hf["torch_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        if tokenizer_dir is not None:
            for name in _TOKENIZER_FILES:
                if (Path(tokenizer_dir) / name).is_file():
                    shutil.copy2(Path(tokenizer_dir) / name, tmp / name)
