"""Spill: atomic safetensors shards + manifest; a restarted buffer (or another process) gets back
identical tensors, rewards and steps."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from fastdraft.databuffer import (
    DataBuffer,
    Sample,
    SpillStore,
    load_spill,
    read_manifest,
)
from tests.databuffer.helpers import make_sample, sample_bytes

REPO = Path(__file__).resolve().parents[2]


def _same(a: Sample, b: Sample) -> None:
    assert a.key == b.key and a.policy_version == b.policy_version and a.reward == b.reward
    for name in ("token_ids", "positions", "hidden", "loss_mask"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert len(a.aux_hidden) == len(b.aux_hidden)
    assert all(torch.equal(x, y) for x, y in zip(a.aux_hidden, b.aux_hidden))


def _fill(buf: DataBuffer) -> list[Sample]:
    """Two steps of samples with aux states, some evicted (spilled) on the way."""
    added = []
    for step in range(2):
        for i in range(5):
            s = make_sample(i, 4 + 3 * i, rl_step=step, num_aux=2, policy_version=step,
                            reward=0.5 * i if i % 2 else None)
            buf.add(s)
            added.append(s)
        if step == 0:
            buf.advance_step()
    return added


def test_evicted_and_flushed_samples_restore_identically(tmp_path: Path) -> None:
    capacity = sample_bytes(60, num_aux=2)
    buf = DataBuffer(capacity, spill_dir=tmp_path)
    added = _fill(buf)
    evicted = buf.stats().evicted_samples
    assert evicted > 0 and buf.stats().spilled_samples == evicted
    assert buf.set_reward((0, 0), -1.0)          # evicted: its reward goes to the manifest
    assert buf.set_reward((1, 4), 2.5)           # resident
    assert buf.flush() == buf.stats().num_samples
    assert buf.flush() == 0                      # nothing new to write
    assert buf.set_reward((1, 4), 3.0)           # resident and on disk: both updated

    on_disk = {s.key: s for s in load_spill(tmp_path)}
    assert set(on_disk) == {s.key for s in added}
    rewards = {(0, 0): -1.0, (1, 4): 3.0}
    for s in added:
        _same(on_disk[s.key], s.with_reward(rewards.get(s.key, s.reward)))

    big = DataBuffer.restore(tmp_path, 10**6)
    assert big.step == buf.step == 1
    assert [s.key for s in big.samples()] == [s.key for s in added]
    stats = big.stats()
    assert (stats.current_samples, stats.previous_samples) == (5, 5)

    same = DataBuffer.restore(tmp_path, capacity)  # the newest that fit: what buf holds
    assert [s.key for s in same.samples()] == [s.key for s in buf.samples()]
    for a, b in zip(same.samples(), buf.samples()):
        _same(a, b)
    assert same.stats().num_bytes == buf.stats().num_bytes <= capacity
    # restored samples are known to be on disk: rewards reach the manifest, no re-spill
    assert same.set_reward((0, 1), 9.0)
    assert {s.key: s.reward for s in load_spill(tmp_path)}[(0, 1)] == 9.0
    assert same.flush() == 0


def test_files_are_published_atomically(tmp_path: Path) -> None:
    buf = DataBuffer(sample_bytes(20), spill_dir=tmp_path)
    for i in range(6):
        buf.add(make_sample(i, 8))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert not [n for n in names if n.endswith(".tmp")]
    manifest = read_manifest(tmp_path)
    shards = sorted({r.shard for r in manifest.records})
    assert [n for n in names if n.startswith("shard-")] == shards
    assert manifest.next_shard == len(shards)

    # a crash after publishing a shard but before the manifest names it: the orphan is ignored
    # and the next write replaces it
    orphan = tmp_path / f"shard-{manifest.next_shard:06d}.safetensors"
    orphan.write_bytes(b"half written")
    assert {s.key for s in load_spill(tmp_path)} == {r.key for r in manifest.records}
    buf.flush()
    assert {s.key for s in load_spill(tmp_path)} == {(0, i) for i in range(6)}


def test_concurrent_writers_lose_no_records(tmp_path: Path) -> None:
    """Two stores on one directory (as two processes would be): the flock serialises them."""
    def write(worker: int) -> None:
        store = SpillStore(tmp_path)
        for i in range(8):
            store.write([(make_sample(i, 3, rl_step=worker), 0)], step=worker)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    manifest = read_manifest(tmp_path)
    assert {r.key for r in manifest.records} == {(w, i) for w in range(2) for i in range(8)}
    assert manifest.next_shard == 16 and manifest.step == 1


def test_foreign_manifest_is_refused(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError, match="fresh directory"):
        DataBuffer(100, spill_dir=tmp_path)


CHILD = """
import json, sys
from fastdraft.databuffer import load_spill
out = {f"{s.rl_step},{s.request_index}": [s.hidden.float().sum().item(), s.num_tokens,
       len(s.aux_hidden), s.reward] for s in load_spill(sys.argv[1])}
print(json.dumps(out))
"""


def test_another_process_reads_the_spill(tmp_path: Path) -> None:
    buf = DataBuffer(sample_bytes(60, num_aux=2), spill_dir=tmp_path)
    added = _fill(buf)
    buf.flush()
    result = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(result.stdout)
    want = {f"{s.rl_step},{s.request_index}": [s.hidden.float().sum().item(), s.num_tokens,
                                               2, s.reward] for s in added}
    assert got == want
