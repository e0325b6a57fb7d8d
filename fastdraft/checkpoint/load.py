"""Resume from a checkpoint: weights in place, optimizer, scheduler and RNG restored."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from fastdraft.checkpoint.layout import (
    CONFIG_FILE,
    FORMAT,
    MODEL_DIR,
    STATE_FILE,
    TENSORS_FILE,
    CorruptCheckpointError,
    validate,
)
from fastdraft.checkpoint.state import LoadedState, RngState
from fastdraft.checkpoint.tree import unflatten
from fastdraft.errors import FastdraftError
from fastdraft.models import load_named_tensors
from fastdraft.models.loading import iter_safetensors


def load_checkpoint(path: str | Path, model: torch.nn.Module | None = None,
                    optimizer: torch.optim.Optimizer | None = None,
                    scheduler: Any | None = None, digests: bool = True) -> LoadedState:
    """Validates `path` first, with every file's SHA-256 unless digests=False (a damaged
    checkpoint raises CorruptCheckpointError naming the file before anything is changed), then
    copies the weights into `model`'s parameters in place (the engine and CUDA graphs keep
    their storage) and restores optimizer, scheduler and RNGs. model=None leaves the weights
    to the caller (a sharded actor builds itself from `path / "model"`, or reads its shards:
    LoadedState.sharded, checkpoint/sharded.load_shards); the optimizer and scheduler states
    come back in the LoadedState too."""
    path = Path(path)
    validate(path, digests=digests)
    state = _read(path, STATE_FILE, lambda p: json.loads(p.read_text()))
    if state.get("format") != FORMAT:
        raise FastdraftError(f"{path / STATE_FILE} has format {state.get('format')!r}; this "
                             "fastdraft "
                             f"reads format {FORMAT}: resume with the fastdraft that wrote it")
    tensors = _read(path, TENSORS_FILE, lambda p: load_file(str(p)))
    if model is not None and state.get("actor") == "dcp":
        raise FastdraftError(f"checkpoint {path} holds the actor's shards (actor/): load them "
                             "with checkpoint.sharded.load_shards, or consolidate() them")
    if model is not None:
        loaded = set(_read(path, MODEL_DIR,
                           lambda p: load_named_tensors(model, iter_safetensors(p))))
        missing = {n for n, _ in model.named_parameters()} - loaded
        if missing:
            raise FastdraftError(f"checkpoint {path / MODEL_DIR} lacks {len(missing)} weights of "
                                 f"this model, e.g. {sorted(missing)[:3]}: was it saved from "
                                 "another model?")
    trees = _read(path, TENSORS_FILE, lambda _: {k: unflatten(state.get(k), tensors)
                                                  for k in ("optimizer", "scheduler", "rng",
                                                            "drafter")})
    if optimizer is not None:
        optimizer.load_state_dict(trees["optimizer"])
    if scheduler is not None:
        if trees["scheduler"] is None:
            raise FastdraftError(f"checkpoint {path} has no LR scheduler state (it was saved with "
                                 "TrainState.scheduler=None): build the run without a scheduler")
        scheduler.load_state_dict(trees["scheduler"])
    RngState.from_tree(trees["rng"]).restore()
    config = _read(path, CONFIG_FILE, lambda p: json.loads(p.read_text()))
    return LoadedState(path=path, step=int(state["step"]), config=config, extra=state["extra"],
                       drafter=trees["drafter"], optimizer=trees["optimizer"],
                       scheduler=trees["scheduler"], sharded=state.get("actor") == "dcp")


def _read(ckpt: Path, rel: str, read: Any) -> Any:
    """Runs `read(ckpt / rel)`; damage that validate() cannot see (bad bytes inside a tensor,
    a dangling tensor key) becomes a CorruptCheckpointError naming the file."""
    try:
        return read(ckpt / rel)
    except (OSError, SafetensorError, json.JSONDecodeError, KeyError) as e:
        raise CorruptCheckpointError(ckpt, rel, f"unreadable ({e!r})") from e
