"""A GRPO group's equal prompts are prefilled once, and every request still goes on exactly as
if it had been prefilled alone: the completions (greedy and sampled, plain and speculative) are
those of each request generated on its own, with its own random stream."""

from __future__ import annotations

import pytest
import torch

from fastdraft.config.engine import SpecConfig
from fastdraft.engine import RolloutEngine, SamplingParams
from fastdraft.engine.prefix_share import SharedPrefill


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


def test_the_drafter_runs_a_groups_prompt_once_and_every_row_gets_its_cache(tiny_checkpoint,
                                                                            random_drafter):
    """The EAGLE drafter's prefill of a group: the prompt's pairs run once, each row takes
    them and runs its own last pair; its cache cells and next root are those of a prefill
    that ran every row (share_prompts off)."""
    path, _ = tiny_checkpoint
    spec = SpecConfig(method="eagle", depth=3, topk=2, tokens_to_verify=6)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 60, (int(n),), generator=g).tolist() for n in (5, 9, 2, 14)]
    groups = [p for p in prompts for _ in range(4)]
    params = SamplingParams(temperature=1.0, max_new_tokens=1, seed=2)
    states, pairs = [], []
    for share in (True, False):
        engine = RolloutEngine(path, "cpu", max_batch_size=16, max_seq_len=96,
                               drafter=random_drafter, spec=spec)
        engine.share_prompts = share
        proposer, ran = engine.proposer, []
        real = proposer.advance
        proposer.advance = lambda feats, ids, *rest, ran=ran, real=real: ran.append(
            ids.numel()) or real(feats, ids, *rest)
        engine.generate(groups, params, use_tqdm=False)
        states.append((proposer.k[0].clone(), proposer.v[0].clone(),
                       proposer.root_feat[:16].clone()))
        pairs.append(sum(ran))
    width = max(map(len, prompts))
    assert pairs == [4 * width + 16, 16 * width]          # the prompts once, then each row
    (k, v, root), (k_ref, v_ref, root_ref) = states
    torch.testing.assert_close(root, root_ref, rtol=1e-4, atol=1e-5)
    for row, prompt in enumerate(groups):                 # cells 1..len: the row's pairs
        for cache, ref in ((k, k_ref), (v, v_ref)):
            torch.testing.assert_close(cache[row, :, 1: len(prompt) + 1],
                                       ref[row, :, 1: len(prompt) + 1], rtol=1e-4, atol=1e-5)
