"""The actor on a GPU (skipped on CPU machines): fp32 masters sharded by FSDP2 over one rank
(nccl), bf16 compute, one optimizer step, and a push that gives the CUDA engine bf16 casts of
the masters; fp16 compute with its loss scale on CUDA."""

from __future__ import annotations

import pytest
import torch

from fastdraft import RolloutEngine
from fastdraft.actor.rank import ActorSpec
from fastdraft.algo.sequences import build_batch
from fastdraft.config.sections import ActorConfig, AlgorithmConfig
from fastdraft.workers.actor import Actor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _spec(path, compute: str) -> ActorSpec:
    return ActorSpec(policy_dir=path, reference_dir=path,
                     actor=ActorConfig(lr=1e-3, compute_dtype=compute),
                     algorithm=AlgorithmConfig(loss="grpo"), temperature=1.0,
                     max_new_tokens=8, max_positions=64, device="cuda", num_steps=2)


def _batch():
    g = torch.Generator().manual_seed(0)
    answers = [torch.randint(3, 60, (int(n),), generator=g).tolist() for n in (4, 9, 6)]
    return build_batch([[5, 6, 7], [8, 9], [10, 11, 12]], answers,
                       [[-2.0] * len(a) for a in answers], [1.0, -0.5, 0.25])


@pytest.mark.parametrize("compute", ["bfloat16", "float16"])
def test_cuda_actor_updates_fp32_masters_and_pushes_bf16_casts(tiny_checkpoint, compute):
    path, _ = tiny_checkpoint
    actor = Actor(_spec(path, compute))
    try:
        result = actor.update(_batch())
        assert result.applied and actor.step == 1
        engine = RolloutEngine(path, device="cuda", dtype=torch.bfloat16, max_batch_size=4,
                               max_seq_len=64)
        engine.load_weights(actor.full_parameters())
        masters = dict(actor.full_parameters())
        for name, param in engine.model.named_parameters():
            assert masters[name].dtype == torch.float32 and masters[name].is_cuda
            assert torch.equal(param, masters[name].to(torch.bfloat16)), name
    finally:
        actor.close()
