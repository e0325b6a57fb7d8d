"""Shared bench plumbing: side-by-side timing (median of repeats), a printed table, JSON output."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from fastdraft.errors import FastdraftError
from fastdraft.utils.atomic import atomic_write_text
from fastdraft.utils.outputs import check_output_dir, json_stamp, mark, remove_output

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | None) -> torch.dtype | None:
    """A --dtype name -> torch dtype (None: the engine's default for its device)."""
    if name is None:
        return None
    if name not in DTYPES:
        raise FastdraftError(f"unknown dtype {name!r}; choose from {sorted(DTYPES)}")
    return DTYPES[name]


def device_name(device: str) -> str:
    """What a bench ran on, for its JSON: the GPU's name, else the host processor."""
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def _sync() -> None:
    # GPU work is asynchronous: a timer must wait for it (a no-op until CUDA is in use).
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> tuple[float, Any]:
    """Runs fn warmup + repeats times; returns (median seconds of the timed runs, last result)."""
    return interleaved_medians({"": fn}, repeats, warmup)[""]


def interleaved_medians(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1
                        ) -> dict[str, tuple[float, Any]]:
    """Times several contenders round-robin (A B C A B C ...), so a machine that drifts or
    stutters during the run (shared or virtualised hosts) hits each of them alike; returns
    {name: (median seconds of its timed runs, its last result)}."""
    results: dict[str, Any] = {}
    for _ in range(warmup):
        for name, fn in fns.items():
            results[name] = fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync()
            start = time.perf_counter()
            results[name] = fn()
            _sync()
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(times[name]), results.get(name)) for name in fns}


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    def fmt(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    widths = [max(len(c), *(len(fmt(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(fmt(r[c]).rjust(w) for c, w in zip(columns, widths)))


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    """Atomic write: temp file in the same directory, then rename; stamped as fastdraft's (a
    later --json may replace it: utils/outputs.py)."""
    atomic_write_text(path, json.dumps({**json_stamp("bench"), **payload}, indent=2))


def fresh_run_dirs(out_dir: Path, names: Iterable[str]) -> dict[str, Path]:
    """`out_dir/NAME` for each arm, emptied of an earlier bench's run: every one checked before
    any is removed (a directory fastdraft did not write there is refused, nothing removed)."""
    dirs = {name: out_dir / name for name in names}
    hint = "or choose another --out-dir"
    for path in dirs.values():
        check_output_dir(path, "run", "--out-dir", hint=hint)
    for path in dirs.values():
        remove_output(path, "run", "--out-dir", hint=hint)
        path.mkdir(parents=True)
        mark(path, "run")
    return dirs
