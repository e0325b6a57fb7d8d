"""Shared bench plumbing: side-by-side timing (median of repeats), a printed table, JSON output."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastdraft.utils.atomic import atomic_write_text


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> tuple[float, Any]:
    """Runs fn warmup + repeats times; returns (median seconds of the timed runs, last result)."""
    result = None
    for _ in range(warmup):
        result = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    def fmt(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    widths = [max(len(c), *(len(fmt(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(fmt(r[c]).rjust(w) for c, w in zip(columns, widths)))


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    """Atomic write: temp file in the same directory, then rename."""
    atomic_write_text(path, json.dumps(payload, indent=2))
