"""Spill store: DataBuffer samples on disk as safetensors shards, so a restart (or another
process) keeps the data.

Layout of a spill directory:
  shard-NNNNNN.safetensors  tensors of the samples written together: "{slot}.token_ids",
                            "{slot}.positions", "{slot}.hidden", "{slot}.loss_mask",
                            "{slot}.aux.{j}"; never rewritten once published
  manifest.json             the cursor: buffer step, next shard number, and one record per
                            sample (key, shard, slot, policy version, step added, reward, bytes)
  .lock                     flock target that serialises writers

Process safety. Writers (any process) hold an exclusive flock on `.lock` while they read the
manifest, publish a shard and rewrite the manifest, so concurrent writers never lose each
other's records. Readers take no lock: a shard is published by temp file + fsync + os.replace
before the manifest names it, and the manifest itself is replaced atomically
(utils.atomic.atomic_write_text), so a reader in any process sees a complete manifest whose every
shard is complete. Rewards live in the manifest, not in the shards, because they arrive after the
sample was spilled. A shard left behind by a crash before its manifest update is never named;
the next write reuses its number and replaces it.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from safetensors import safe_open

from fastdraft.databuffer.sample import Sample, SampleKey, WindowKey
from fastdraft.errors import FastdraftError
from fastdraft.utils.atomic import atomic_write_text, fsync_dir
from fastdraft.utils.tensor_file import save_tensors

MANIFEST = "manifest.json"
LOCK_FILE = ".lock"
FORMAT = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class SpillRecord:
    """Where one spilled sample lives and what the buffer knew about it."""

    shard: str
    slot: int
    rl_step: int
    request_index: int
    policy_version: int
    added_step: int   # the buffer step during which the sample was added
    reward: float | None
    nbytes: int
    num_aux: int
    start: int = 0    # the sample's first position (a later window of a long rollout: > 0)

    @property
    def key(self) -> SampleKey:
        return (self.rl_step, self.request_index)

    @property
    def window_key(self) -> WindowKey:
        return (self.rl_step, self.request_index, self.start)


@dataclass(frozen=True, slots=True)
class Manifest:
    step: int                       # the writer's buffer step at its last write
    next_shard: int
    records: tuple[SpillRecord, ...]

    def latest(self) -> list[SpillRecord]:
        """One record per window (the last written wins), in write order."""
        last = {r.window_key: i for i, r in enumerate(self.records)}
        return [r for i, r in enumerate(self.records) if last[r.window_key] == i]


def read_manifest(root: str | Path) -> Manifest:
    """The manifest of a spill directory; an empty one where nothing was spilled yet."""
    path = Path(root) / MANIFEST
    if not path.exists():
        return Manifest(step=0, next_shard=0, records=())
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("format") != FORMAT:
        raise FastdraftError(f"{path}: spill format {data.get('format')!r} is not {FORMAT}; "
                             "spill into a fresh directory")
    return Manifest(step=data["step"], next_shard=data["next_shard"],
                    records=tuple(SpillRecord(**r) for r in data["records"]))


def _write_manifest(root: Path, manifest: Manifest) -> None:
    data = {"format": FORMAT, "step": manifest.step, "next_shard": manifest.next_shard,
            "records": [asdict(r) for r in manifest.records]}
    atomic_write_text(root / MANIFEST, json.dumps(data, indent=0))


def _sample_tensors(slot: int, sample: Sample) -> dict:
    tensors = {f"{slot}.token_ids": sample.token_ids, f"{slot}.positions": sample.positions,
               f"{slot}.hidden": sample.hidden, f"{slot}.loss_mask": sample.loss_mask}
    tensors.update({f"{slot}.aux.{j}": a for j, a in enumerate(sample.aux_hidden)})
    return tensors


def _publish_shard(root: Path, name: str, tensors: dict) -> None:
    """safetensors file written beside its final name, fsynced, then renamed onto it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=root)
    os.close(fd)
    try:
        save_tensors(tensors, tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, root / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(root)


class SpillStore:
    """Appends samples to a spill directory and updates their rewards; see the module doc."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        read_manifest(self.root)  # fail now, not at the first eviction, on a foreign format

    @contextmanager
    def _locked(self) -> Iterator[Manifest]:
        # flock conflicts between separate open()s, in one process or several.
        with open(self.root / LOCK_FILE, "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield read_manifest(self.root)
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def manifest(self) -> Manifest:
        return read_manifest(self.root)

    def write(self, items: Sequence[tuple[Sample, int]], step: int) -> None:
        """Spills (sample, added_step) pairs as one new shard (none when items is empty) and
        records `step` as the buffer's step."""
        with self._locked() as old:
            records, next_shard = list(old.records), old.next_shard
            if items:
                name = f"shard-{next_shard:06d}.safetensors"
                tensors: dict = {}
                for slot, (sample, added_step) in enumerate(items):
                    tensors.update(_sample_tensors(slot, sample))
                    records.append(SpillRecord(
                        shard=name, slot=slot, rl_step=sample.rl_step,
                        request_index=sample.request_index, policy_version=sample.policy_version,
                        added_step=added_step, reward=sample.reward, nbytes=sample.nbytes,
                        num_aux=len(sample.aux_hidden), start=sample.start))
                _publish_shard(self.root, name, tensors)
                next_shard += 1
            _write_manifest(self.root, Manifest(max(step, old.step), next_shard, tuple(records)))

    def set_reward(self, key: SampleKey, reward: float | None) -> bool:
        """Sets the reward of every spilled record of `key` (each window of the rollout);
        False when none is on disk."""
        with self._locked() as old:
            found = any(r.key == key for r in old.records)
            if found:
                records = tuple(SpillRecord(**{**asdict(r), "reward": reward})
                                if r.key == key else r for r in old.records)
                _write_manifest(self.root, Manifest(old.step, old.next_shard, records))
        return found


def load_records(root: str | Path, records: Sequence[SpillRecord]) -> list[Sample]:
    """The samples of `records` (from read_manifest), in the given order."""
    root = Path(root)
    by_shard: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        by_shard.setdefault(r.shard, []).append(i)
    out: list[Sample | None] = [None] * len(records)
    for shard, indices in by_shard.items():
        with safe_open(str(root / shard), framework="pt") as f:
            for i in indices:
                r = records[i]
                get = f.get_tensor
                out[i] = Sample(
                    request_index=r.request_index, policy_version=r.policy_version,
                    rl_step=r.rl_step, token_ids=get(f"{r.slot}.token_ids"),
                    positions=get(f"{r.slot}.positions"), hidden=get(f"{r.slot}.hidden"),
                    loss_mask=get(f"{r.slot}.loss_mask"),
                    aux_hidden=tuple(get(f"{r.slot}.aux.{j}") for j in range(r.num_aux)),
                    reward=r.reward)
    return [s for s in out if s is not None]


def load_spill(root: str | Path) -> list[Sample]:
    """Every sample of a spill directory (latest record per key, in write order), with the
    rewards the manifest holds. Safe to call from any process while a buffer keeps spilling."""
    return load_records(root, read_manifest(root).latest())
