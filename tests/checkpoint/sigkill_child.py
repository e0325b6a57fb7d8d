"""Child process of the SIGKILL test: resumes from the latest checkpoint in RUN_DIR (if any) and
saves checkpoints as fast as it can until it is killed. Weights and Adam moments of step s are
all exactly s, so the parent knows what every checkpoint must contain. It starts work once a line
arrives on stdin, so the parent can start the next child (imports take seconds) early.

    python -m tests.checkpoint.sigkill_child RUN_DIR
"""

from __future__ import annotations

import itertools
import sys
import warnings

import torch

from fastdraft.checkpoint import CheckpointManager, TrainState
from tests.checkpoint.tiny import tiny_model


def fill(model: torch.nn.Module, optimizer: torch.optim.Optimizer, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
        for state in optimizer.state.values():
            state["exp_avg"].fill_(value)
            state["exp_avg_sq"].fill_(value)


def main(run_dir: str) -> None:
    torch.set_num_threads(1)  # the test machine's cores are shared: spinning OMP threads crawl
    model = tiny_model(hidden=256, layers=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # one step with zero gradients creates the Adam moments
        p.grad = torch.zeros_like(p)
    optimizer.step()
    sys.stdin.readline()  # started early (imports take seconds); go once the parent says so
    manager = CheckpointManager(run_dir, keep=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the temp dir our predecessor left when it was killed
        latest = manager.latest()
    start = 1 if latest is None else manager.load(latest, model, optimizer).step + 1
    for step in itertools.count(start):
        fill(model, optimizer, float(step))
        manager.save(step, TrainState(model=model, optimizer=optimizer.state_dict(), step=step,
                                      extra={"step": step}))


if __name__ == "__main__":
    main(sys.argv[1])
