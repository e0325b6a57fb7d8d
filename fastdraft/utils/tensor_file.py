"""safetensors' save_file with the OS error a user can act on: a full or read-only disk reaches
Python as a SafetensorError whose text holds "os error N"; here it is the OSError it is (with
the file's name), so the CLI names the path and the setting that chose it (errors.py)."""

from __future__ import annotations

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
