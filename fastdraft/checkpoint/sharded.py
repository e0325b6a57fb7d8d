"""Sharded checkpoints: the actor's fp32 masters and AdamW state written by its ranks, each its
own shard, with torch.distributed.checkpoint (DCP), and read back by any number of ranks (DCP
reshards: 2 hybrid workers -> 1 process -> 4 workers). Hybrid workers write these, so no rank
ever holds more than its shard and nothing goes through the driver.

    step-000012/
        actor/.metadata             DCP's index (rank 0 writes it)
        actor/__R_0.distcp          rank R's shard of {"model": masters, "optim": AdamW state}
        model/config.json           the policy's config only (`consolidated` writes the weights)
        state.safetensors, state.json ("actor": "dcp"), run_config.json, COMPLETE

The rest of the layout, the digests in COMPLETE and the atomic publish are every checkpoint's
(checkpoint/layout.py); each rank hashes the files it wrote, rank 0 lists them all.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fastdraft.checkpoint.layout import ACTOR_DIR, MODEL_DIR
from fastdraft.models import CausalLM, ModelConfig, save_model
from fastdraft.utils.file_digest import file_sha256

METADATA = ".metadata"


@dataclass(frozen=True, slots=True)
class ShardedActor:
    """A TrainState's model when the actor's ranks write their own shards (save_shards): the
    checkpoint's writer puts only the config in model/."""

    config: ModelConfig


def is_sharded(ckpt: Path) -> bool:
    return (Path(ckpt) / ACTOR_DIR / METADATA).is_file()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextmanager
def _one_process() -> Iterator[None]:
    """DCP warns that a call without a process group is one process's: here it means to be."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, into: Path
                ) -> dict[str, dict]:
    """Collective over the actor's ranks: this rank's shard of the masters and optimizer state
    into `into`/actor (fsynced). Returns the COMPLETE entries ({"size", "sha256"}) of the files
    this rank wrote (rank 0: DCP's index too)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    out = Path(into) / ACTOR_DIR
    with _one_process():
        dcp.save({"model": model_sd, "optim": optim_sd},
                 storage_writer=dcp.FileSystemWriter(out, sync_files=True),
                 no_dist=not _distributed())
    rank = dist.get_rank() if _distributed() else 0
    own = sorted(out.glob(f"__{rank}_*"))
    if rank == 0:
        own.append(out / METADATA)
    return {f"{ACTOR_DIR}/{f.name}": {"size": f.stat().st_size, "sha256": file_sha256(f)}
            for f in own}


def load_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ckpt: Path) -> None:
    """Collective over the actor's ranks (however many wrote it): this rank's part of the
    masters and optimizer state from checkpoint `ckpt`, in place."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with _one_process():
        dcp.load(state, checkpoint_id=Path(ckpt) / ACTOR_DIR, no_dist=not _distributed())
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def save_config(config: ModelConfig, model_dir: Path) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    hf = {**config.to_hf_dict(), "torch_dtype": "float32"}
    (model_dir / "config.json").write_text(json.dumps(hf, indent=2))


def consolidate(ckpt: Path, out: Path) -> Path:
    """The masters of sharded checkpoint `ckpt` as one HF model directory at `out` (one
    process, no process group: what `fastdraft export` and an HF tool read)."""
    ckpt = Path(ckpt)
    config = ModelConfig.from_pretrained(ckpt / MODEL_DIR)
    with torch.device("meta"):
        model = CausalLM(config, max_positions=1)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    state = {"model": model.state_dict()}
    with _one_process():
        dcp.load(state, checkpoint_id=ckpt / ACTOR_DIR, no_dist=True)
    model.load_state_dict(state["model"])
    save_model(model, out)
    return Path(out)


@contextmanager
def policy_weights(ckpt: Path) -> Iterator[Path]:
    """An HF directory of checkpoint `ckpt`'s policy: its model/ when it holds the weights,
    else the shards consolidated into a temporary directory for the block's length."""
    ckpt = Path(ckpt)
    if not is_sharded(ckpt):
        yield ckpt / MODEL_DIR
        return
    with tempfile.TemporaryDirectory(prefix="fastdraft-policy-") as tmp:
        yield consolidate(ckpt, Path(tmp) / "model")
