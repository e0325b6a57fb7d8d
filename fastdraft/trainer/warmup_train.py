"""The warm-up's training: SpotTrainer micro-steps over the captured samples (packed rows of
token_budget tokens, fp32 masters and AdamW, the policy's states read in the serving dtype),
alone or as one member of a data-parallel group (a GradReduce summing the members' gradients
weighted by tokens, trainer/data_parallel.py: every member takes the same step). The leading
member shows a progress bar (steps, ETA, trained tokens/s, loss) and saves the trainer's state
every `save_every` steps, atomically: a killed warm-up resumes from its last save."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from fastdraft.errors import FastdraftError
from fastdraft.trainer.spot import GradReduce, SpotStats, SpotTrainer

STATE_FILE = "trainer_state.pt"


def train_warmup(trainer: SpotTrainer, steps: int, work_dir: str | Path, *,
                 reduce: GradReduce | None = None, lead: bool = True, save_every: int = 50,
                 progress: bool = True) -> SpotStats:
    """Micro-steps until the trainer has taken `steps` in all (a resumed one continues from its
    saved state in work_dir); returns its stats."""
    state_file = Path(work_dir) / STATE_FILE
    if state_file.is_file():
        trainer.load_state(torch.load(state_file, weights_only=False))
    bar = tqdm(total=steps, initial=trainer.stats.steps, unit="step", desc="drafter warm-up",
               disable=not (lead and progress), dynamic_ncols=True)
    start, start_tokens = time.perf_counter(), trainer.stats.tokens
    while trainer.stats.steps < steps:
        if not trainer.step(reduce):
            raise FastdraftError("the warm-up has no samples to train on: the captured rollouts "
                                 "hold no answer tokens (max_new_tokens 0, or every prompt "
                                 "ended at once)")
        bar.update(1)
        elapsed = time.perf_counter() - start
        bar.set_postfix(tok_s=f"{(trainer.stats.tokens - start_tokens) / elapsed:.0f}",
                        loss=f"{trainer.stats.last.get('loss', float('nan')):.3f}",
                        refresh=False)
        if lead and (trainer.stats.steps % save_every == 0 or trainer.stats.steps == steps):
            save_state(trainer, state_file)
    bar.close()
    return trainer.stats


def save_state(trainer: SpotTrainer, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(trainer.state(), tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
