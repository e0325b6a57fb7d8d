"""On-disk layout of one checkpoint, and the check that a directory is a whole one.

    run_dir/checkpoints/step-000012/
        model/config.json           HF checkpoint of the actor (fastdraft.models.save_model)
        model/model.safetensors
        state.safetensors           every other tensor: optimizer moments, scheduler tensors, RNG
        state.json                  {"format", "step", "optimizer", "scheduler", "rng", "extra"};
                                    tensor leaves are {"__tensor__": key} into state.safetensors
        run_config.json             the run's config dict
        actor/                      hybrid workers' checkpoints: the actor's shards, one file
                                    per rank (torch.distributed.checkpoint), model/ holds only
                                    config.json (checkpoint/sharded.py)
        COMPLETE                    written last: {"step", "files": {relative path:
                                    {"size", "sha256"}}}

A checkpoint is written into `.step-000012.tmp-*` beside its final name and renamed when whole,
so a `step-*` directory without COMPLETE, or whose files differ from the sizes COMPLETE lists,
was damaged after the fact (or by hand) and is never loaded. Sizes are checked whenever a
checkpoint is listed (cheap); the SHA-256 of every file when one is resumed from, so that bytes
damaged inside a file of the right size are found before they are loaded.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from safetensors import SafetensorError, safe_open

from fastdraft.errors import FastdraftError
from fastdraft.utils.file_digest import CorruptFileError, check_file, file_sha256, tree_files

FORMAT = 2   # 2: optimizer state keyed by parameter name (FSDP2 full state dict)
MODEL_DIR = "model"
ACTOR_DIR = "actor"   # a sharded actor's masters and optimizer state (checkpoint/sharded.py)
TENSORS_FILE = "state.safetensors"
STATE_FILE = "state.json"
CONFIG_FILE = "run_config.json"
MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CorruptCheckpointError(FastdraftError):
    """A checkpoint directory that is incomplete or damaged; the message names the file."""

    def __init__(self, ckpt: Path, file: str, reason: str) -> None:
        self.path, self.file, self.reason = ckpt, file, reason
        super().__init__(f"checkpoint {ckpt} is incomplete or corrupt: {ckpt / file}: {reason}. "
                         f"Delete {ckpt} and resume from an older checkpoint "
                         "(CheckpointManager.latest() skips damaged ones).")

    def skipped(self) -> str:
        """The one line of a resume that passes over it (the older checkpoint is used)."""
        return (f"skipping the damaged checkpoint {self.path}: {self.path / self.file}: "
                f"{self.reason}; trying the one before it (delete the damaged one when done)")


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def step_of(path: Path) -> int | None:
    """The step a `step-NNNNNN` directory holds; None for anything else (temp dirs included)."""
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def step_dirs(ckpt_root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every published-looking checkpoint dir, oldest first (not validated)."""
    if not ckpt_root.is_dir():
        return []
    found = [(step_of(p), p) for p in ckpt_root.iterdir() if p.is_dir()]
    return sorted((s, p) for s, p in found if s is not None)


def temp_dirs(ckpt_root: Path) -> list[Path]:
    """Leftovers of writes that never finished (process killed mid-write)."""
    if not ckpt_root.is_dir():
        return []
    return sorted(p for p in ckpt_root.iterdir() if p.name.startswith(".step-"))


def manifest(ckpt: Path, known: dict[str, dict] | None = None) -> dict[str, dict]:
    """Relative path -> {"size", "sha256"} of every file under `ckpt` (what COMPLETE records);
    `known`: entries the files' writers made (a sharded actor's ranks), not hashed again."""
    known = known or {}
    return {rel: known.get(rel) or {"size": (ckpt / rel).stat().st_size,
                                    "sha256": file_sha256(ckpt / rel)}
            for rel in tree_files(ckpt, exclude=(MARKER,))}


def validate(ckpt: Path, digests: bool = False) -> int:
    """Returns the checkpoint's step, or raises CorruptCheckpointError naming the first bad file.
    Cheap by default (sizes and safetensors headers, no tensor data read), so `latest()` can
    call it often; digests=True also hashes every file against COMPLETE (a checkpoint written
    before digests were kept is checked by size only)."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise FileNotFoundError(f"checkpoint {ckpt} does not exist: pass a directory such as "
                                f"run_dir/checkpoints/{step_dir_name(0)}")
    try:
        marker = json.loads((ckpt / MARKER).read_text())
        step, files = int(marker["step"]), dict(marker["files"])
    except FileNotFoundError:
        raise CorruptCheckpointError(ckpt, MARKER, "missing (the write never finished)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(ckpt, MARKER, f"unreadable ({e})") from e
    if step_of(ckpt) not in (None, step):
        raise CorruptCheckpointError(ckpt, MARKER, f"records step {step}, not the directory's")
    for rel in (f"{MODEL_DIR}/config.json", STATE_FILE, CONFIG_FILE, TENSORS_FILE,
                *((f"{ACTOR_DIR}/.metadata",) if (ckpt / ACTOR_DIR).is_dir() else ())):
        if rel not in files:
            raise CorruptCheckpointError(ckpt, rel, f"not listed in {MARKER}")
    for rel, entry in files.items():
        size = entry if isinstance(entry, int) else dict(entry).get("size")
        path = ckpt / rel
        actual = path.stat().st_size if path.is_file() else None
        if actual != size:
            what = "missing" if actual is None else f"{actual} bytes, {MARKER} says {size}"
            raise CorruptCheckpointError(ckpt, rel, f"{what} (truncated or replaced)")
        try:
            if rel.endswith(".safetensors"):
                with safe_open(str(path), framework="pt") as f:
                    f.keys()
            elif rel.endswith(".json"):
                json.loads(path.read_text())
        except (OSError, ValueError, SafetensorError) as e:
            raise CorruptCheckpointError(ckpt, rel, f"unreadable ({e})") from e
    if digests:
        for rel, entry in files.items():
            if isinstance(entry, dict) and entry.get("sha256"):
                try:
                    check_file(ckpt / rel, entry["sha256"])
                except CorruptFileError as e:
                    raise CorruptCheckpointError(ckpt, rel, e.reason) from e
    return step
