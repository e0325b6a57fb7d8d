"""GPU checks: run where CUDA is present (skipped on the CPU machines)."""

from __future__ import annotations

import pytest
import torch

from fastdraft import RolloutEngine, SamplingParams
from fastdraft.engine.spec.config import SpecConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cuda_greedy_matches_cpu_fp32(tiny_checkpoint):
    path, _ = tiny_checkpoint
    prompts = [[3 + (i * 7 + j) % 60 for j in range(5 + i)] for i in range(8)]
    params = SamplingParams(greedy=True, max_new_tokens=24)
    cpu = RolloutEngine(path, max_batch_size=8, max_seq_len=128).generate(prompts, params)
    gpu = RolloutEngine(path, device="cuda", dtype=torch.float32, max_batch_size=8,
                        max_seq_len=128).generate(prompts, params)
    assert [c.token_ids for c in cpu] == [c.token_ids for c in gpu]


def _prompts() -> list[list[int]]:
    return [[3 + (i * 5 + j) % 60 for j in range(3 + 2 * i)] for i in range(6)]


@pytest.mark.parametrize("method", ["eagle", "suffix"])
def test_cuda_speculative_greedy_equals_plain_greedy(tiny_checkpoint, random_drafter, method):
    path, _ = tiny_checkpoint
    params = SamplingParams(greedy=True, max_new_tokens=24)
    plain = RolloutEngine(path, device="cuda", dtype=torch.float32, max_batch_size=4,
                          max_seq_len=128).generate(_prompts(), params)
    spec = SpecConfig(method=method, depth=4, topk=2, tokens_to_verify=8)
    engine = RolloutEngine(path, device="cuda", dtype=torch.float32, max_batch_size=4,
                           max_seq_len=128, spec=spec,
                           drafter=random_drafter if method == "eagle" else None)
    for _ in range(2):  # the second round lets the suffix drafter match earlier rollouts
        outs = engine.generate(_prompts(), params)
        assert [c.token_ids for c in outs] == [c.token_ids for c in plain]
        engine.advance_step()


def test_cuda_sampled_eagle_runs_with_mixed_requests(tiny_checkpoint, random_drafter):
    """Sampled rows take the per-tree rejection sampler, greedy rows the batched walk."""
    path, _ = tiny_checkpoint
    spec = SpecConfig(method="eagle", depth=4, topk=2, tokens_to_verify=8)
    engine = RolloutEngine(path, device="cuda", max_batch_size=4, max_seq_len=128, spec=spec,
                           drafter=random_drafter)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_new_tokens=16)
              if i % 2 else SamplingParams(greedy=True, max_new_tokens=16)
              for i in range(len(_prompts()))]
    outs = engine.generate(_prompts(), params)
    assert all(len(c.token_ids) == len(c.logprobs) > 0 for c in outs)
    assert all(lp <= 0.0 for c in outs for lp in c.logprobs)
