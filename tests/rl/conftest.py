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


@pytest.fixture(scope="session")
def policy_and_drafter(tmp_path_factory):
    """The bootstrap policy (cached) and an untrained EAGLE-1 drafter for it: what the CLI runs
    of the signal and fault tests serve."""
    from fastdraft.bootstrap.run import run_bootstrap
    policy_dir = run_bootstrap().policy_dir
    policy = load_model(policy_dir)
    torch.manual_seed(0)
    drafter = tmp_path_factory.mktemp("stop-drafter")
    save_drafter(build_drafter("eagle1", policy.config, 256).attach(policy), drafter)
    return policy_dir, drafter
