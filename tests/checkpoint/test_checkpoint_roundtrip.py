"""Save -> load into fresh objects gives back exactly the same training state."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from fastdraft.checkpoint import CheckpointManager, TrainState
from fastdraft.models import load_model
from tests.checkpoint.tiny import tiny_model, train_steps


def _setup(seed: int):
    model = tiny_model(seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 0.5 ** i)
    return model, optimizer, scheduler


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(4)


def test_round_trip_restores_weights_optimizer_scheduler_rng_and_extra(tmp_path):
    torch.manual_seed(0)
    model, optimizer, scheduler = _setup(seed=0)
    train_steps(model, optimizer, 2, scheduler)
    manager = CheckpointManager(tmp_path, keep=3)
    state = TrainState(model=model, optimizer=optimizer.state_dict(), step=7,
                       scheduler=scheduler.state_dict(), config={"lr": 1e-2, "name": "tiny"},
                       extra={"metrics_cursor": 123, "seen": [1, 2]})
    expected_draws = _draws()  # what the loop draws right after the checkpoint
    manager.save(7, state)
    manager.wait()
    path = manager.latest()
    assert path == tmp_path / "checkpoints" / "step-000007"

    fresh_model, fresh_opt, fresh_sched = _setup(seed=1)
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    loaded = manager.load(path, fresh_model, fresh_opt, fresh_sched)
    assert (loaded.step, loaded.extra) == (7, {"metrics_cursor": 123, "seen": [1, 2]})
    assert loaded.config == {"lr": 1e-2, "name": "tiny"}
    draws = _draws()
    assert draws[:2] == expected_draws[:2] and torch.equal(draws[2], expected_draws[2])

    for (name, a), (_, b) in zip(model.named_parameters(), fresh_model.named_parameters()):
        assert torch.equal(a, b), name
    ours, theirs = optimizer.state_dict(), fresh_opt.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    for i, st in ours["state"].items():
        for key, value in st.items():
            assert torch.equal(value, theirs["state"][i][key]), (i, key)
    assert fresh_sched.state_dict() == scheduler.state_dict()

    hf = load_model(path / "model")  # the weights are a plain HF checkpoint directory
    assert hf.config == model.config
    for (name, a), (_, b) in zip(hf.named_parameters(), fresh_model.named_parameters()):
        assert torch.equal(a, b), name

    # Training on from both gives identical weights: nothing the update depends on was lost.
    for m, opt, sched in ((model, optimizer, scheduler), (fresh_model, fresh_opt, fresh_sched)):
        torch.manual_seed(5)
        train_steps(m, opt, 2, sched)
    for (name, a), (_, b) in zip(model.named_parameters(), fresh_model.named_parameters()):
        assert torch.equal(a, b), name
    manager.close()


def test_save_copies_to_host_before_returning(tmp_path, monkeypatch):
    """The loop changes its tensors right after save() returns; the checkpoint must not see it."""
    import threading

    import fastdraft.checkpoint.manager as manager_mod
    release, real = threading.Event(), manager_mod.write_checkpoint
    monkeypatch.setattr(manager_mod, "write_checkpoint",
                        lambda snap, root, *rest: (release.wait(10), real(snap, root, *rest))[1])
    model, optimizer, _ = _setup(seed=0)
    train_steps(model, optimizer, 1)
    before = [p.detach().clone() for p in model.parameters()]
    manager = CheckpointManager(tmp_path, keep=1)
    manager.save(1, TrainState(model=model, optimizer=optimizer.state_dict(), step=1,
                               extra={"n": 1}))
    assert not (manager.root / "step-000001").exists()  # still being written
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(42.0)
        for st in optimizer.state.values():
            st["exp_avg"].fill_(42.0)
    release.set()
    manager.wait()
    fresh, fresh_opt, _ = _setup(seed=1)
    manager.load(manager.latest(), fresh, fresh_opt)
    for a, b in zip(before, fresh.parameters()):
        assert torch.equal(a, b)
    assert all(not torch.all(st["exp_avg"] == 42.0) for st in fresh_opt.state.values())


def test_unsaveable_state_fails_in_the_caller(tmp_path):
    model, optimizer, _ = _setup(seed=0)
    manager = CheckpointManager(tmp_path, keep=1)
    with pytest.raises(ValueError, match=r"TrainState\.config must be JSON-serialisable"):
        manager.save(1, TrainState(model=model, optimizer=optimizer.state_dict(), step=1,
                                   config={"out": tmp_path}))
    with pytest.raises(ValueError, match="TrainState of step 2"):
        manager.save(1, TrainState(model=model, optimizer=optimizer.state_dict(), step=2))
    with pytest.raises(ValueError, match="keep must be >= 1"):
        CheckpointManager(tmp_path, keep=0)
    manager.close()
