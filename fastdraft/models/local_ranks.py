"""Runs a function on every rank of a tensor-parallel replica on this machine: `size` spawned
processes joined by a gloo group, `threads` threads each; fn(TPRank, *args) runs on each and
its results come back in rank order (torch.save'd). What the tests and `fastdraft bench tp`
use; a run's replicas are hybrid workers (workers/hybrid.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastdraft.models.tensor_parallel import TPRank


def run_ranks(size: int, fn: Callable[..., Any], *args: Any, workdir: Path,
              timeout: float = 600, threads: int = 1) -> list[Any]:
    ctx = mp.get_context("spawn")
    store = workdir / "tp-store"
    store.unlink(missing_ok=True)
    outs = [workdir / f"tp-rank{r}.pt" for r in range(size)]
    procs = [ctx.Process(target=_rank_main,
                         args=(rank, size, str(store), fn, args, outs[rank], threads))
             for rank in range(size)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    codes = [proc.exitcode for proc in procs]
    if codes != [0] * size:
        raise RuntimeError(f"tensor-parallel ranks exited with {codes} (their tracebacks are "
                           "above)")
    return [torch.load(path, weights_only=False) for path in outs]


def _rank_main(rank: int, size: int, store: str, fn: Callable[..., Any], args: tuple,
               out: Path, threads: int) -> None:
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    try:
        torch.save(fn(TPRank(rank, size), *args), out)
    finally:
        dist.destroy_process_group()
