"""Pruning, skipping of damaged checkpoints, clear errors, and writer failures that surface."""

from __future__ import annotations

import os

import pytest
import torch

import fastdraft.checkpoint.write as write_mod
from fastdraft.checkpoint import (
    CheckpointManager,
    CheckpointWarning,
    CheckpointWriteError,
    CorruptCheckpointError,
    TrainState,
)
from tests.checkpoint.tiny import tiny_model


@pytest.fixture(scope="module")
def model_and_opt():
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return model, optimizer


def _save(manager, step, model_and_opt, block=False):
    model, optimizer = model_and_opt
    manager.save(step, TrainState(model=model, optimizer=optimizer.state_dict(), step=step,
                                  extra={"step": step}), block=block)


def _names(manager):
    return sorted(p.name for p in manager.root.iterdir())


def test_keeps_only_the_newest_k(tmp_path, model_and_opt):
    manager = CheckpointManager(tmp_path, keep=2)
    for step in range(1, 6):
        _save(manager, step, model_and_opt)
    manager.wait()
    assert _names(manager) == ["step-000004", "step-000005"]
    # A run resumed from step 4 must not have its new checkpoints pruned in favour of step 5.
    _save(manager, 3, model_and_opt, block=True)
    assert _names(manager) == ["step-000003", "step-000004", "step-000005"]
    manager.close()


def test_latest_skips_incomplete_corrupt_and_temp_dirs(tmp_path, model_and_opt):
    manager = CheckpointManager(tmp_path, keep=10)
    for step in range(1, 5):
        _save(manager, step, model_and_opt)
    manager.wait()
    root = manager.root
    (root / "step-000004" / "COMPLETE").unlink()  # as if published without its marker
    weights = root / "step-000003" / "model" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    state = root / "step-000002" / "state.safetensors"
    with state.open("r+b") as f:  # same size, garbage header: only parsing finds it
        f.write(b"\xff" * 16)
    (root / ".step-000005.tmp-abc123").mkdir()  # a write killed mid-way
    with pytest.warns(CheckpointWarning) as caught:
        assert manager.latest() == root / "step-000001"
    text = "\n".join(str(w.message) for w in caught)
    for name in ("step-000004/COMPLETE", "step-000003/model/model.safetensors",
                 "step-000002/state.safetensors", ".step-000005.tmp-abc123"):
        assert name in text, name

    for bad, file in (("step-000004", "COMPLETE"), ("step-000003", "model/model.safetensors"),
                      ("step-000002", "state.safetensors")):
        with pytest.raises(CorruptCheckpointError, match=r"Delete .* resume from an older") as e:
            manager.load(root / bad, tiny_model())
        assert str(root / bad / file) in str(e.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        manager.load(root / "step-000099", tiny_model())

    _save(manager, 5, model_and_opt, block=True)  # the next save clears the leftover temp dir
    assert not [n for n in _names(manager) if n.startswith(".")]
    assert manager.latest() == root / "step-000005"
    manager.close()


def test_writer_error_surfaces_at_next_save_and_wait(tmp_path, model_and_opt, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    manager = CheckpointManager(tmp_path, keep=2)
    monkeypatch.setattr(write_mod, "save_model", disk_full)
    _save(manager, 1, model_and_opt)  # returns: the write fails in the background
    with pytest.raises(CheckpointWriteError, match=r"step-000001.*No space left") as e:
        _save(manager, 2, model_and_opt)
    assert isinstance(e.value.__cause__, OSError)
    _save(manager, 3, model_and_opt)
    with pytest.raises(CheckpointWriteError, match="step-000003"):
        manager.wait()
    manager.wait()  # raised once, not forever
    assert _names(manager) == []  # nothing half-written left behind
    assert manager.latest() is None

    monkeypatch.undo()
    _save(manager, 4, model_and_opt, block=True)
    assert manager.latest() == manager.root / "step-000004"
    with pytest.raises(CheckpointWriteError):
        monkeypatch.setattr(write_mod, "save_model", disk_full)
        with manager:  # close() raises the last write's error too
            _save(manager, 5, model_and_opt)


def test_poll_raises_a_failed_write_without_waiting_for_a_running_one(tmp_path, model_and_opt,
                                                                     monkeypatch):
    """A step boundary's look: a write still running is left to run, one that failed raises
    once, with the checkpoint's path and the OS error (and pickles whole: a hybrid worker's
    reaches the driver)."""
    import pickle
    import threading
    release = threading.Event()

    def full_later(*args, **kwargs):
        release.wait(timeout=30)
        raise OSError(28, "No space left on device", str(tmp_path / "checkpoints" / "x"))

    manager = CheckpointManager(tmp_path, keep=2)
    monkeypatch.setattr(write_mod, "save_model", full_later)
    _save(manager, 1, model_and_opt)
    manager.poll()   # running: nothing to say, nothing waited for
    release.set()
    manager._pending[1].exception(timeout=30)   # the write has ended (failed)
    with pytest.raises(CheckpointWriteError, match=r"step-000001 not written.*No space") as e:
        manager.poll()
    assert isinstance(e.value.__cause__, OSError) and e.value.error.errno == 28
    again = pickle.loads(pickle.dumps(e.value))
    assert again.path == manager.root / "step-000001" and again.__cause__.errno == 28
    manager.poll()
    manager.wait()   # raised once
    assert _names(manager) == []   # its temp dir removed
    manager.close()


def test_a_checkpoint_dir_that_takes_no_directory_fails_the_save_itself(tmp_path, model_and_opt,
                                                                        monkeypatch):
    """chmod a-w on checkpoints/: the save of that step raises (its temp dir is made there),
    not a later one; the earlier checkpoint stays the newest."""
    import fastdraft.checkpoint.manager as manager_mod
    manager = CheckpointManager(tmp_path, keep=2)
    _save(manager, 1, model_and_opt, block=True)

    def denied(final):
        raise PermissionError(13, "Permission denied", str(final.parent / ".step-000002.tmp"))
    monkeypatch.setattr(manager_mod, "temp_dir_for", denied)
    with pytest.raises(CheckpointWriteError, match=r"step-000002 not written.*Permission") as e:
        _save(manager, 2, model_and_opt)
    assert e.value.error.errno == 13
    manager.wait()   # nothing pending
    assert manager.latest() == manager.root / "step-000001"
    manager.close()


def _damage_inside(path, offset_from_end=64):
    """Overwrites bytes inside the file's data, size unchanged: sizes and headers still agree."""
    with path.open("r+b") as f:
        f.seek(path.stat().st_size - offset_from_end)
        f.write(bytes(16))


def test_a_same_size_damaged_file_is_found_by_its_digest_at_resume(tmp_path, model_and_opt):
    manager = CheckpointManager(tmp_path, keep=10)
    for step in (1, 2):
        _save(manager, step, model_and_opt)
    manager.wait()
    root = manager.root
    weights = root / "step-000002" / "model" / "model.safetensors"
    _damage_inside(weights)
    assert manager.latest() == root / "step-000002"    # the cheap listing cannot see it
    with pytest.warns(CheckpointWarning, match=r"step-000002/model/model\.safetensors.*SHA-256"):
        assert manager.latest(digests=True) == root / "step-000001"
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors.*SHA-256"):
        manager.load(root / "step-000002", tiny_model())       # a direct load hashes too
    assert manager.load(root / "step-000001", tiny_model()).step == 1
    manager.close()


def test_a_checkpoint_written_before_digests_still_resumes(tmp_path, model_and_opt):
    """COMPLETE used to record only sizes: such checkpoints are checked by size and load."""
    import json
    manager = CheckpointManager(tmp_path, keep=10)
    _save(manager, 1, model_and_opt, block=True)
    marker = manager.root / "step-000001" / "COMPLETE"
    record = json.loads(marker.read_text())
    assert all(len(e["sha256"]) == 64 for e in record["files"].values())
    record["files"] = {rel: e["size"] for rel, e in record["files"].items()}
    marker.write_text(json.dumps(record))
    assert manager.latest(digests=True) == manager.root / "step-000001"
    assert manager.load(manager.root / "step-000001", tiny_model()).step == 1
    manager.close()
