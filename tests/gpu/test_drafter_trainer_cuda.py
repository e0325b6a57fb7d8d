"""The online drafter trainer on CUDA (skipped on the CPU machines): its Ray actor builds the
trainer on the GPU, trains there from host samples, and publishes what it trained; in an
engine on CUDA the default device (the policy's) is the GPU, never the host's cores."""

from __future__ import annotations

import pytest
import torch

from fastdraft import RolloutEngine, SpecConfig
from fastdraft.config.sections import OnlineDrafterConfig
from fastdraft.trainer.service import TrainerSetup
from fastdraft.trainer.spot import SpotConfig, SpotStats
from fastdraft.utils.digest import tensor_digest
from tests.trainer.online_helpers import online_drafter, start_own_actor
from tests.trainer.test_spot import _samples, _setup, train_until

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("local_ray")]


def test_the_trainer_actor_trains_on_cuda(tiny_checkpoint):
    policy, drafter = _setup(tiny_checkpoint)
    worker = start_own_actor(TrainerSetup(
        drafter=drafter, policy_config=policy.config,
        embed=policy.model.embed_tokens.weight.detach().clone(), lm_head=None,
        spot=SpotConfig(token_budget=64, device="cuda"), buffer_bytes=2**24, offset_mix=0.5,
        seed=0, num_threads=1), OnlineDrafterConfig(enabled=True), SpotStats())
    try:
        first = worker.publish()
        train_until(worker, _samples(policy, 12), steps=5, timeout_s=120)
        worker.pause()
        worker.settle()
        published = worker.publish()
        assert worker.stats.device.startswith("cuda")
        assert all(t.device.type == "cpu" for _, t in published.tensors)   # host copies out
        assert published.checksum == tensor_digest(published.tensors) != first.checksum
        state = worker.state()
        assert "cuda_rng" in state and all(
            t.device.type == "cpu" for t in state["drafter"].values())
    finally:
        worker.close()


def test_by_default_the_trainer_follows_a_cuda_policy(tiny_checkpoint, random_drafter):
    engine = RolloutEngine(tiny_checkpoint[0], device="cuda", max_batch_size=4, max_seq_len=64,
                           drafter=random_drafter, spec=SpecConfig(method="eagle", depth=3,
                                                                   topk=2, tokens_to_verify=4))
    online = online_drafter(OnlineDrafterConfig(enabled=True), engine)
    try:
        assert online.device.startswith("cuda")
        online.worker.publish()
        assert online.worker.stats.device.startswith("cuda")
    finally:
        online.close()
