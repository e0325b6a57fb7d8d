"""The background half of a save: put a Snapshot on disk so that `step-NNNNNN/` appears whole or
not at all, whenever the process dies (SIGKILL, OOM killer, pre-emption) or the power fails."""

from __future__ import annotations

import json
from pathlib import Path

from fastdraft.checkpoint.layout import (
    CONFIG_FILE,
    MARKER,
    MODEL_DIR,
    STATE_FILE,
    TENSORS_FILE,
    manifest,
    step_dir_name,
)
from fastdraft.checkpoint.sharded import ShardedActor, save_config
from fastdraft.checkpoint.snapshot import Snapshot
from fastdraft.models import save_model
from fastdraft.utils.atomic import atomic_dir, atomic_write_text, fsync_dir, fsync_tree
from fastdraft.utils.tensor_file import save_tensors


def write_checkpoint(snap: Snapshot, ckpt_root: Path, into: Path | None = None,
                     shards: dict[str, dict] | None = None) -> Path:
    """Writes into a temp dir beside the final name, fsyncs every file, writes COMPLETE (with the
    size of every file, so later truncation is detected) and renames. Returns the final path.
    A sharded actor's checkpoint: `into` is the temp dir its ranks wrote their shards into,
    `shards` their COMPLETE entries (each rank hashed its own).

    The order matters: data, fsync, marker, fsync, rename, fsync of the parent. A rename that
    reached the disk therefore always names a directory whose data and marker reached it first.
    """
    final = ckpt_root / step_dir_name(snap.step)
    # Inside the run's own directory (locked by the run): a damaged step dir there is replaced.
    with atomic_dir(final, into, kind="checkpoint", overwrite=True) as tmp:
        if isinstance(snap.model, ShardedActor):
            save_config(snap.model.config, tmp / MODEL_DIR)
        else:
            save_model(snap.model, tmp / MODEL_DIR)
        save_tensors(snap.tensors, str(tmp / TENSORS_FILE))
        (tmp / STATE_FILE).write_text(snap.state_json)
        (tmp / CONFIG_FILE).write_text(snap.config_json)
        fsync_tree(tmp)
        marker = {"step": snap.step, "files": manifest(tmp, shards or {})}
        atomic_write_text(tmp / MARKER, json.dumps(marker, indent=1))
        fsync_dir(tmp)
    fsync_dir(ckpt_root)
    return final
