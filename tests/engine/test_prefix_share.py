"""A GRPO group's equal prompts are prefilled once, and every request still goes on exactly as
if it had been prefilled alone: the completions (greedy and sampled, plain and speculative) are
those of each request generated on its own, with its own random stream."""

from __future__ import annotations

import pytest
import torch

from fastdraft.engine import RolloutEngine, SamplingParams
from fastdraft.engine.prefix_share import SharedPrefill
from fastdraft.engine.spec.config import SpecConfig


def test_distinct_prompts_in_first_seen_order():
    share = SharedPrefill.of([[1, 2], [1, 2], [3], [1, 2], [3], [4, 5, 6]])
    assert share.prompts == [[1, 2], [3], [4, 5, 6]]
    assert share.source == [0, 0, 1, 0, 1, 2]
    assert share.shared and share.rows_tokens == 11 and share.computed_tokens == 6
    assert not SharedPrefill.of([[1], [2]]).shared


@pytest.mark.parametrize("spec", [None, SpecConfig(method="eagle", depth=3, topk=2,
                                                   tokens_to_verify=6)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_group_prefilled_once_answers_as_each_request_alone(tiny_checkpoint, random_drafter,
                                                               spec, temperature):
    path, _ = tiny_checkpoint
    engine = RolloutEngine(path, "cpu", max_batch_size=16, max_seq_len=96,
                           drafter=random_drafter if spec else None, spec=spec)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 60, (int(n),), generator=g).tolist()
               for n in (5, 9, 2, 14)]
    groups = [p for p in prompts for _ in range(4)]   # the loop's layout: a group together
    params = SamplingParams(temperature=temperature, max_new_tokens=24, seed=11)
    together = engine.generate(groups, params, use_tqdm=False)
    trace = engine.last_trace
    assert trace.prefill_tokens == 4 * trace.prefill_computed == 4 * sum(map(len, prompts))
    alone = [engine.generate([p], params, use_tqdm=False, stream_ids=[i])[0]
             for i, p in enumerate(groups)]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert torch.allclose(torch.tensor([lp for c in together for lp in c.logprobs]),
                          torch.tensor([lp for c in alone for lp in c.logprobs]), atol=1e-4)
