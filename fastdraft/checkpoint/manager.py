"""CheckpointManager: asynchronous, crash-safe checkpoints of the GRPO loop, newest `keep` kept."""

from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from fastdraft.checkpoint.layout import (
    CorruptCheckpointError,
    step_dir_name,
    step_dirs,
    temp_dirs,
    validate,
)
from fastdraft.checkpoint.load import load_checkpoint
from fastdraft.checkpoint.snapshot import HostMirror, take_snapshot
from fastdraft.checkpoint.state import LoadedState, TrainState
from fastdraft.checkpoint.write import write_checkpoint
from fastdraft.errors import FastdraftError
from fastdraft.utils.atomic import temp_dir_for


class CheckpointWarning(UserWarning):
    """A checkpoint directory was skipped (incomplete, corrupt or a leftover temp dir)."""


class CheckpointWriteError(RuntimeError):
    """Checkpoint `path` was not written: its temp dir could not be made (raised by save()), or
    the background write failed (raised by the next poll(), save() or wait()). `error` is what
    failed (also `__cause__`; `error` survives pickling: a hybrid worker's reaches the driver)."""

    def __init__(self, path: str | Path, error: BaseException) -> None:
        super().__init__(f"checkpoint {path} not written: {error!r}")
        self.path, self.error = Path(path), error
        self.__cause__ = error

    def __reduce__(self) -> tuple:
        return type(self), (self.path, self.error)

    @property
    def what_failed(self) -> str:   # the CLI's one line starts with it (errors.py)
        return f"checkpoint {self.path} not written"


class CheckpointManager:
    """Saves TrainStates under `run_dir/checkpoints/step-NNNNNN/` without making the loop wait for
    the disk: `save` copies the state to host memory, one background thread writes it.

    At most one write is in flight: `save` first waits for the previous one. That bounds host
    memory to one snapshot (a second would need another copy of weights and optimizer moments,
    ~3x the model) and keeps the order of checkpoints on disk the order of steps. One manager
    (one process) per run_dir; call it from one thread.
    """

    def __init__(self, run_dir: str | Path, keep: int) -> None:
        if keep < 1:
            raise FastdraftError(f"keep must be >= 1 (checkpoints to keep), got {keep}")
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastdraft-ckpt")
        self._pending: tuple[int, Future[Path]] | None = None
        self._mirror = HostMirror()
        self._hashed: set[Path] = set()   # checkpoints latest(digests=True) has hashed
        self.last_write_s = 0.0   # the last background write's seconds (a stop's estimate)
        # A write another process makes into this root (hybrid workers' rank 0): wait() waits
        # for it too, so latest() never races it.
        self.pending_elsewhere: Callable[[], None] | None = None
        self.poll_elsewhere: Callable[[], None] | None = None   # poll()'s look at that write

    def save(self, step: int, state: TrainState, block: bool = False,
             into: Path | None = None, shards: dict[str, dict] | None = None) -> None:
        """Returns once the state is copied to host; the write goes on in the background unless
        `block`. A failed earlier write raises CheckpointWriteError here, before anything else;
        so does a checkpoint dir that takes no new directory (its temp dir is made here).
        A sharded actor (state.model a ShardedActor): `into` is the temp dir its ranks wrote
        their shards into (temp_dir), `shards` their COMPLETE entries; the rest is written and
        the whole published as any checkpoint."""
        self.wait()
        snap = take_snapshot(step, state, self._mirror)
        if into is None:   # made here: a directory that takes no files fails this save, not later
            try:
                into = temp_dir_for(self.root / step_dir_name(step))
            except OSError as e:
                raise CheckpointWriteError(self.root / step_dir_name(step), e) from e
        self._pending = (step, self._pool.submit(self._write, snap, into, shards))
        if block:
            self.wait()

    def poll(self) -> None:
        """Without waiting (a step boundary's look): a pending write that failed raises its
        CheckpointWriteError here, once; one still running is left to run (the next poll(),
        save() or wait() sees it)."""
        if self.poll_elsewhere is not None:
            self.poll_elsewhere()
        if self._pending is not None and self._pending[1].done():
            self._finish_pending()

    def wait(self) -> None:
        """Blocks until the pending write (if any) is on disk; re-raises its error once."""
        if self.pending_elsewhere is not None:
            self.pending_elsewhere()
        self._finish_pending()

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        (step, future), self._pending = self._pending, None
        try:
            future.result()
        except Exception as e:
            raise CheckpointWriteError(self.root / step_dir_name(step), e) from e

    def temp_dir(self, step: int) -> Path:
        """A temp dir for checkpoint `step` that writers in other processes fill before save()
        publishes it (a sharded actor's ranks: checkpoint/sharded.py); after the pending write,
        whose pruning removes leftover temp dirs."""
        self.wait()
        try:
            return temp_dir_for(self.root / step_dir_name(step))
        except OSError as e:
            raise CheckpointWriteError(self.root / step_dir_name(step), e) from e

    def latest(self, digests: bool = False) -> Path | None:
        """The newest checkpoint that validates. Damaged and unfinished ones are skipped with a
        CheckpointWarning naming them, so a resumed run never loads half a checkpoint. Waits for
        a pending write first: it counts, and the writer's pruning must not race the listing.
        digests=True (a resume) also hashes every file against COMPLETE: bytes damaged inside a
        file of the right size skip that checkpoint too, and load() does not hash it again."""
        self.wait()
        for tmp in temp_dirs(self.root):
            warnings.warn(f"skipping {tmp}: an unfinished checkpoint write (the process died "
                          "mid-write); it is removed after the next successful save",
                          CheckpointWarning, stacklevel=2)
        for _, path in reversed(step_dirs(self.root)):
            try:
                validate(path, digests=digests)
            except CorruptCheckpointError as e:
                warnings.warn(e.skipped(), CheckpointWarning, stacklevel=2)
                continue
            if digests:
                self._hashed.add(path)
            return path
        return None

    def load(self, path: str | Path, model: torch.nn.Module | None = None,
             optimizer: torch.optim.Optimizer | None = None,
             scheduler: Any | None = None) -> LoadedState:
        """See fastdraft.checkpoint.load.load_checkpoint (digests checked unless latest() just
        did)."""
        return load_checkpoint(path, model, optimizer, scheduler,
                               digests=Path(path) not in self._hashed)

    def close(self) -> None:
        """Waits for the pending write (raising its error) and stops the writer thread."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, snap: Any, into: Path | None, shards: dict[str, dict] | None) -> Path:
        start = time.perf_counter()
        path = write_checkpoint(snap, self.root, into, shards)
        self._prune(snap.step)
        self.last_write_s = time.perf_counter() - start
        return path

    def _prune(self, step: int) -> None:
        """Keeps the newest `keep` valid checkpoints up to `step` and removes leftover temp dirs
        (the only writer is this thread, so none of them is being written). Damaged checkpoints
        are left for a person to inspect; checkpoints newer than `step` (a run resumed from an
        older one) are neither counted nor deleted."""
        valid = []
        for s, path in step_dirs(self.root):
            if s <= step:
                try:
                    validate(path)
                    valid.append(path)
                except CorruptCheckpointError:
                    pass
        for tmp in temp_dirs(self.root):
            shutil.rmtree(tmp, ignore_errors=True)
        for path in valid[:-self.keep]:
            # Renamed out of sight first: a kill mid-delete leaves a temp dir, not a step dir.
            trash = path.with_name(f".{path.name}.deleting")
            os.replace(path, trash)
            shutil.rmtree(trash, ignore_errors=True)
