"""GraphPool: CUDA graphs of the engine's steps, captured lazily per static shape, all in ONE
memory pool; eager everywhere else.

A step stage is a function of no arguments that reads static input buffers and writes static
output buffers (engine/step_buffers.py), for one shape key: (stage, batch bucket, context
bucket, tree shape, sampling mode). Keys name shapes, not strategies, so two speculation
strategies that share a shape (the decode step, a verify width, a drafter topk) share one graph.
Graphs never run concurrently and every stage copies its results out of the pool, so all
captures can share a single pool: memory is that of the largest stage, not the sum of all.

Stages must be idempotent for fixed inputs (warm-up runs before a capture execute them): they
write the same cells with the same values, and draw random numbers from counters, not state.

A capture owns its process's device while it runs: `torch.cuda.graph` empties the caching
allocator first, so any other thread's next allocation is a `cudaMalloc` during the capture, and
work another thread queues meanwhile may interleave with the captured stream's. Captures run in
thread-local mode (another thread's legal calls do not invalidate them) and under
CAPTURE_GUARD, which every other device worker in the process (the online drafter trainer
member: trainer/service.py) holds around its own device work, so none overlaps a capture.

Storages the graphs read (the KV cache, the weights) must not move while the graphs live: a
sleep that frees them releases the graphs and their pool with them (`release`), and the next
run of each key captures again into a fresh pool (reusing a pool whose graphs died trips the
caching allocator when a block allocated during a capture outlived it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from fastdraft.errors import FastdraftError

#: Held while a graph is warmed up and captured; the process's other device workers hold it
#: around their device work (module docstring). One per process: captures and members of one
#: process share one device.
CAPTURE_GUARD = threading.Lock()


@dataclass(slots=True)
class GraphStats:
    num_graphs: int = 0          # captures since the pool was made (or reset)
    capture_s: float = 0.0       # their seconds: warm-ups, capture and the synchronize
    pool_bytes: int = 0          # memory the pools grew by during captures

    def as_dict(self) -> dict[str, float]:
        return {"num_graphs": self.num_graphs, "capture_s": self.capture_s,
                "pool_bytes": self.pool_bytes}


class GraphPool:
    """enabled=False (CPU, or graphs switched off) runs every stage eagerly: the same code."""

    def __init__(self, device: torch.device | str, enabled: bool | None = None,
                 warmup: int = 2) -> None:
        device = torch.device(device)
        self.enabled = (device.type == "cuda") if enabled is None else enabled
        if self.enabled and device.type != "cuda":
            raise FastdraftError("CUDA graphs need a CUDA device; pass graphs=False on "
                                 f"{device.type}")
        self.device, self.warmup = device, warmup
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        # One side stream for every warm-up, so their allocations are cached once, not per
        # capture (the caching allocator keeps blocks per stream).
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.stats = GraphStats()

    def run(self, key: Hashable, stage: Callable[[], None]) -> None:
        if not self.enabled:
            stage()
            return
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(stage)
        graph.replay()

    def release(self) -> None:
        """Drops every graph and the pool they share (the storages they read are about to be
        freed: a sleep); its memory goes back with the next `empty_cache`, and the next run of
        a key captures into a fresh pool. The stats go on counting."""
        self._graphs.clear()
        if self.device.type == "cuda":
            self.pool = torch.cuda.graph_pool_handle()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._graphs

    def _capture(self, stage: Callable[[], None]) -> torch.cuda.CUDAGraph:
        start = time.perf_counter()
        with CAPTURE_GUARD:
            graph = self._record(stage)
        self.stats.num_graphs += 1
        self.stats.capture_s += time.perf_counter() - start
        return graph

    def _record(self, stage: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """The stage warmed up and captured (the caller holds CAPTURE_GUARD); what the pool
        grew by is counted."""
        before = torch.cuda.memory_reserved(self.device)
        # Warm-up on a side stream (library handles, autotuning, lazy allocations), then capture.
        side = self._side
        assert side is not None
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                stage()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            stage()
        torch.cuda.synchronize(self.device)
        self.stats.pool_bytes += torch.cuda.memory_reserved(self.device) - before
        return graph

    def reset(self) -> None:
        """`release`, and the stats start again (a bench's next variant)."""
        self.release()
        self.stats = GraphStats()
