"""Reads the history out of an offline wandb run file (run-ID.wandb), so tests can compare it
with metrics.jsonl. The file is a LevelDB-style log: a 7-byte header (":W&B", key, version),
then 32 KiB blocks of records, each a 7-byte header (crc32, length, type) and a chunk of one
protobuf Record; types FULL / FIRST / MIDDLE / LAST put chunks back together."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK, HEADER = 32 * 1024, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    out, parts, pos = [], [], HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:   # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue
        parts.append(chunk)
        if kind in (FULL, LAST):
            out.append(b"".join(parts))
            parts = []
    return out


def history(path: Path) -> list[dict]:
    """Every history row in the file: {"_step": n, key: value, ...}."""
    from wandb.proto import wandb_internal_pb2 as pb
    rows = []
    for blob in records(path):
        record = pb.Record()
        record.ParseFromString(blob)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
