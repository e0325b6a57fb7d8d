"""`fastdraft` with a checkpoint write fault injected (tests/run/test_checkpoint_write_fault.py),
chosen by $FASTDRAFT_TEST_CKPT_FAULT:

    unwritable:checkpoints   once step-000001 is published, RUN/checkpoints takes no new entry
                             (as after `chmod a-w RUN/checkpoints` for a user who is not root:
                             root, which the tests may run as, ignores the mode bits)
    unwritable:run           the same for every directory under RUN (the drafter's, the
                             export's, ...): only files already open still take bytes
    write:K                  checkpoint K's background write fails (ENOSPC on its weights) once
                             the step after its boundary has begun (at once when K is the last
                             step); that step's end waits until the write has ended, so its
                             boundary sees a failed write, never a running one

    python -m tests.run.checkpoint_fault_cli run RECIPE ... --run-dir RUN
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import re
import sys
import threading
from pathlib import Path


def _run_dir() -> Path:
    return Path(sys.argv[sys.argv.index("--run-dir") + 1]).absolute()


def _unwritable(scope: str) -> None:
    run_dir = _run_dir()
    checkpoints = run_dir / "checkpoints"
    real_mkdir = os.mkdir

    def mkdir(path, mode=0o777, *, dir_fd=None):
        target = Path(os.fsdecode(path)).absolute()
        inside = (target.parent == checkpoints if scope == "checkpoints"
                  else run_dir in target.parents)
        if (dir_fd is None and inside and (checkpoints / "step-000001").is_dir()
                and not target.exists()):   # an existing one is EEXIST, as the kernel says
            raise PermissionError(errno.EACCES, "Permission denied", str(target))
        return real_mkdir(path, mode, dir_fd=dir_fd)
    os.mkdir = mkdir


def _failing_write(fail: int) -> None:
    import fastdraft.checkpoint.write as write_mod
    from fastdraft.checkpoint.manager import CheckpointManager
    from fastdraft.run.stop import StepClock
    steps = int(next(a.split("=", 1)[1] for a in sys.argv
                     if a.startswith("algorithm.num_steps=")))
    begun: list[int] = []   # the steps whose start_step ran (this process starts at step 0)
    next_step_begun = threading.Event()
    managers: list[CheckpointManager] = []
    real_save_model, real_save = write_mod.save_model, CheckpointManager.save
    real_start, real_end = StepClock.start_step, StepClock.end_step

    def save_model(model, path, *args, **kwargs):
        found = re.search(r"\.step-(\d+)\.tmp", str(path))
        if found and int(found.group(1)) == fail:
            if fail < steps:
                next_step_begun.wait(timeout=120)
            raise OSError(errno.ENOSPC, "No space left on device",
                          str(Path(path) / "model.safetensors"))
        return real_save_model(model, path, *args, **kwargs)

    def save(self, step, *args, **kwargs):
        managers.append(self)
        return real_save(self, step, *args, **kwargs)

    def start_step(self):
        begun.append(len(begun))
        if begun[-1] == fail:
            next_step_begun.set()
        return real_start(self)

    def end_step(self):
        if begun and begun[-1] == fail and managers and managers[-1]._pending is not None:
            concurrent.futures.wait([managers[-1]._pending[1]], timeout=120)
        return real_end(self)

    write_mod.save_model = save_model
    CheckpointManager.save = save
    StepClock.start_step, StepClock.end_step = start_step, end_step


def main() -> int:
    kind, _, arg = os.environ["FASTDRAFT_TEST_CKPT_FAULT"].partition(":")
    if kind == "unwritable":
        _unwritable(arg)
    elif kind == "write":
        _failing_write(int(arg))
    else:
        raise SystemExit(f"unknown FASTDRAFT_TEST_CKPT_FAULT {kind!r}")
    from fastdraft.cli import main as cli_main
    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
