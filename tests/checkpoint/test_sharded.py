"""Sharded checkpoints (checkpoint/sharded.py): the actor's masters and AdamW state written with
torch.distributed.checkpoint into the temp dir of a checkpoint the manager publishes whole; read
back exactly (the next step equals an unbroken one), consolidated into an HF directory, and a
shard damaged inside a file of the right size is found by its digest. Several ranks writing,
and fewer reading, run in tests/workers/test_hybrid.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import load_file

from fastdraft.checkpoint import CheckpointManager, CheckpointWarning, TrainState
from fastdraft.checkpoint.layout import validate
from fastdraft.checkpoint.sharded import (
    ShardedActor,
    is_sharded,
    load_shards,
    policy_weights,
    save_shards,
)
from tests.checkpoint.tiny import tiny_model, train_steps


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _save(manager: CheckpointManager, step: int, model, optimizer) -> None:
    into = manager.temp_dir(step)
    shards = save_shards(model, optimizer, into)
    manager.save(step, TrainState(model=ShardedActor(model.config), optimizer={}, step=step,
                                  extra={"cursor": step}), into=into, shards=shards, block=True)


def test_a_sharded_checkpoint_resumes_exactly_and_consolidates(tmp_path):
    torch.manual_seed(0)
    model = tiny_model(seed=0)
    optimizer = _adamw(model)
    train_steps(model, optimizer, 3)
    with CheckpointManager(tmp_path, keep=2) as manager:
        _save(manager, 3, model, optimizer)
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
        latest = manager.latest(digests=True)
        assert latest.name == "step-000003" and is_sharded(latest)
        assert validate(latest, digests=True) == 3
        loaded = manager.load(latest)
    assert loaded.sharded and loaded.extra == {"cursor": 3} and loaded.optimizer == {}
    # a fresh actor (other weights, no moments) reads the shards back
    other = tiny_model(seed=1)
    other_opt = _adamw(other)
    load_shards(other, other_opt, latest)
    for (name, a), (_, b) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(a, b), name
    # the next step is the unbroken run's, bit for bit: the moments came back too
    torch.manual_seed(7)
    train_steps(model, optimizer, 1)
    torch.manual_seed(7)
    train_steps(other, other_opt, 1)
    for (name, a), (_, b) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(a, b), name
    # one HF directory of the step-3 masters, for export and HF tools
    with policy_weights(latest) as policy:
        consolidated = load_file(str(policy / "model.safetensors"))
    assert set(consolidated) == set(saved)
    assert all(torch.equal(consolidated[n], t) for n, t in saved.items())


def test_a_damaged_shard_is_found_by_its_digest_and_skipped(tmp_path):
    model = tiny_model()
    optimizer = _adamw(model)
    train_steps(model, optimizer, 1)
    with CheckpointManager(tmp_path, keep=3) as manager:
        _save(manager, 1, model, optimizer)
        train_steps(model, optimizer, 1)
        _save(manager, 2, model, optimizer)
        shard = manager.root / "step-000002" / "actor" / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF   # same size: only the digest sees it
        shard.write_bytes(bytes(data))
        assert manager.latest().name == "step-000002"   # sizes alone pass
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert manager.latest(digests=True).name == "step-000001"
    assert any(issubclass(w.category, CheckpointWarning) and "__0_0.distcp" in str(w.message)
               for w in caught)


def test_a_sharded_checkpoint_refuses_a_plain_load_with_what_to_do(tmp_path):
    from fastdraft.checkpoint import load_checkpoint
    from fastdraft.errors import FastdraftError
    model = tiny_model()
    optimizer = _adamw(model)
    with CheckpointManager(tmp_path, keep=1) as manager:
        _save(manager, 1, model, optimizer)
    with pytest.raises(FastdraftError, match="load_shards"):
        load_checkpoint(manager.root / "step-000001", model=model)
