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

from fastdraft.errors import FastdraftError

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
    why = damaged_safetensors(path)
    if why is not None:
        raise FastdraftError(f"{what}: {path} is damaged ({why}): copy or download it again")


#: safetensors dtypes fastdraft loads weights from (cast to the run's dtype); an integer or
#: quantized tensor would be cast silently into garbage.
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def tensor_headers(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) of every tensor in the file, from its header alone."""
    with Path(path).open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    return {name: (entry["dtype"], tuple(entry["shape"])) for name, entry in header.items()
            if name != "__metadata__"}


def check_tensor_headers(found: dict[str, tuple[str, tuple[int, ...]]],
                         expected: dict[str, tuple[int, ...]], what: str,
                         optional: frozenset[str] = frozenset()) -> None:
    """The tensors a model needs (name -> shape; `optional` ones may be absent) against what
    its files hold (tensor_headers): every one there, of its shape and a float dtype; else a
    FastdraftError naming the first problem and how many share it. `what` names the files."""
    missing = sorted(set(expected) - set(found) - optional)
    if missing:
        raise FastdraftError(f"{what} lacks {len(missing)} of the {len(expected)} weights its "
                             f"config.json needs, e.g. {missing[:3]}: the files are incomplete or "
                             "of another model")
    wrong = [(n, found[n][1], shape) for n, shape in expected.items()
             if n in found and found[n][1] != shape]
    if wrong:
        name, has, want = wrong[0]
        raise FastdraftError(f"{what}: {name} has shape {list(has)}, its config.json says "
                             f"{list(want)} ({len(wrong)} weight(s) differ): the weights and "
                             "config.json are of different models")
    ints = [(n, found[n][0]) for n in expected if n in found and found[n][0] not in FLOAT_DTYPES]
    if ints:
        name, dtype = ints[0]
        raise FastdraftError(f"{what}: {name} is {dtype}, not a float type ({len(ints)} "
                             f"weight(s) are): fastdraft loads float16 / bfloat16 / float32 "
                             "weights; dequantize the checkpoint (or use its unquantized one)")
