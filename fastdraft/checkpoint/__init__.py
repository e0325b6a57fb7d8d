"""Crash-safe, asynchronous checkpoints of the GRPO training loop (layout: see layout.py).

    ckpt = CheckpointManager(run_dir, keep=3)
    if (path := ckpt.latest()) is not None:
        step = ckpt.load(path, model, optimizer, scheduler).step + 1
    ...
    ckpt.save(step, TrainState(model=model, optimizer=optimizer.state_dict(), step=step,
                               scheduler=scheduler.state_dict(), config=cfg, extra=cursor))
    ...
    ckpt.close()  # waits for the last write and raises its error, if any
"""

from fastdraft.checkpoint.layout import CorruptCheckpointError, validate
from fastdraft.checkpoint.load import load_checkpoint
from fastdraft.checkpoint.manager import CheckpointManager, CheckpointWarning, CheckpointWriteError
from fastdraft.checkpoint.state import LoadedState, RngState, TrainState

__all__ = ["CheckpointManager", "CheckpointWarning", "CheckpointWriteError",
           "CorruptCheckpointError", "LoadedState", "RngState", "TrainState", "load_checkpoint",
           "validate"]
