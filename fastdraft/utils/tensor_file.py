"""safetensors' save_file with the OS error a user can act on: a full or read-only disk reaches
Python as a SafetensorError whose text holds "os error N"; here it is the OSError it is (with
the file's name), so the CLI names the path and the setting that chose it (errors.py). And a
damaged file (truncated) is told by its header before anything loads it."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

_OS_ERROR = re.compile(r"os error (\d+)")


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path,
                 metadata: dict[str, str] | None = None) -> None:
    try:
        save_file(tensors, str(path), metadata=metadata or {"format": "pt"})
    except SafetensorError as err:
        found = _OS_ERROR.search(str(err))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from err


def damaged_safetensors(path: str | Path) -> str | None:
    """Why a .safetensors file cannot be whole (a truncated download, a copy cut short), read
    from its header alone: the 8-byte header length, the JSON header, and the tensors' byte
    ranges that must end exactly at the file's end. None: the file is whole as far as the
    header tells."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than a safetensors header"
        length = int.from_bytes(head, "little")
        if length > size - 8:
            return f"its header claims {length} bytes, the file holds {size - 8} after it"
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            return f"its header is not JSON ({err})"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    ends = [entry["data_offsets"][1] for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry]
    expected = 8 + length + max(ends, default=0)
    if expected != size:
        return f"{size} bytes, its header describes {expected}"
    return None


def check_safetensors(path: str | Path, what: str) -> None:
    """A FastdraftError naming the file (what: whose file it is, e.g. "model.path") when the
    header says it is damaged."""
    from fastdraft.errors import FastdraftError
    why = damaged_safetensors(path)
    if why is not None:
        raise FastdraftError(f"{what}: {path} is damaged ({why}): copy or download it again")
