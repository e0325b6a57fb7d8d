"""GPU checks: run where CUDA is present (skipped on the CPU machines)."""

from __future__ import annotations

import pytest
import torch

from fastdraft import RolloutEngine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cuda_greedy_matches_cpu_fp32(tiny_checkpoint):
    path, _ = tiny_checkpoint
    prompts = [[3 + (i * 7 + j) % 60 for j in range(5 + i)] for i in range(8)]
    params = SamplingParams(greedy=True, max_new_tokens=24)
    cpu = RolloutEngine(path, max_batch_size=8, max_seq_len=128).generate(prompts, params)
    gpu = RolloutEngine(path, device="cuda", dtype=torch.float32, max_batch_size=8,
                        max_seq_len=128).generate(prompts, params)
    assert [c.token_ids for c in cpu] == [c.token_ids for c in gpu]
