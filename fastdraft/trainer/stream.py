"""The drafter trainer's CUDA stream: the lowest priority CUDA has, so that where kernels of
several streams compete for the GPU (a hybrid worker's engine beside its trainer member, MPS)
the trainer's are the ones that wait."""

from __future__ import annotations

import contextlib

import torch

#: CUDA maps any larger number to its lowest stream priority.
LOWEST_STREAM_PRIORITY = 1 << 20


def device_stream(device: torch.device) -> contextlib.AbstractContextManager:
    """On CUDA: this thread's device, and a lowest-priority stream for all of the trainer's
    kernels and copies. What keeps the trainer off the rollout's critical path is still the
    go / pause protocol: it trains only in the rollout's tail and during the actor update."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    if device.index is None:   # "cuda": the current one (set_device wants an index)
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    return torch.cuda.stream(torch.cuda.Stream(device, priority=LOWEST_STREAM_PRIORITY))
