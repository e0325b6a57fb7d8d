"""Fixtures of the engine-level statistical tests."""

from __future__ import annotations

import pytest
import torch

from fastdraft.drafter import build_drafter, save_drafter
from fastdraft.models import load_model
from tests.conftest import make_tiny_checkpoint

VOCAB = 8


@pytest.fixture(scope="session")
def tiny_vocab(tmp_path_factory):
    path = tmp_path_factory.mktemp("v8")
    hf = make_tiny_checkpoint(path, vocab_size=VOCAB, seed=3, eos_token_id=None)
    policy = load_model(path)
    torch.manual_seed(4)
    drafter = build_drafter("eagle1", policy.config, 64).attach(policy)
    with torch.no_grad():  # correlated with the policy but clearly different
        for p in drafter.parameters():
            p.mul_(0.5)
    save_drafter(drafter, path / "drafter")
    return path, hf


