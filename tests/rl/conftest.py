"""Fixtures of the RL tests (beside tests/conftest.py's)."""

from __future__ import annotations

import pytest
import torch

from fastdraft.drafter import build_drafter, save_drafter
from fastdraft.models import load_model


@pytest.fixture(scope="session")
def char_eagle3(char_policy, tmp_path_factory):
    """An untrained EAGLE-3 drafter for char_policy (aux layers of its 2 layers: (1, 1, 0))."""
    policy = load_model(char_policy)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("char-eagle3")
    save_drafter(build_drafter("eagle3", policy.config, 512).attach(policy), out)
    return out
