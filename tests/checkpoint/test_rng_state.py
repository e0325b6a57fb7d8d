"""RngState: a resumed run draws what an unbroken one would, and a process that never
initialised CUDA (a driver whose devices are its workers') creates no CUDA context to save its
states: reading them would make one on every visible GPU, memory the workers' plans count on."""

from __future__ import annotations

import random

import torch

from fastdraft.checkpoint.state import RngState


def test_a_restored_state_draws_the_same_numbers():
    state = RngState.capture()
    first = (random.random(), torch.rand(3))
    RngState.from_tree(state.as_tree()).restore()
    again = (random.random(), torch.rand(3))
    assert first[0] == again[0] and torch.equal(first[1], again[1])


def test_a_process_without_cuda_initialised_reads_no_cuda_state(monkeypatch):
    def context_made() -> list:
        raise AssertionError("RngState.capture initialised CUDA: a context on every GPU")

    # A GPU machine's driver: CUDA is there, this process has not touched it.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", context_made)
    assert RngState.capture().torch_cuda == ()
    # A process that works on its GPU (an inline run, a worker) keeps its devices' states.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    saved = [torch.zeros(16, dtype=torch.uint8)]
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: saved)
    assert len(RngState.capture().torch_cuda) == 1
