from __future__ import annotations

import torch

from fastdraft.engine.sampler import SamplingTensors, filter_top_k_top_p, sample
from fastdraft.engine.sampling_params import SamplingParams


def test_top_k_top_p_filter_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    out = filter_top_k_top_p(logits, torch.tensor([4, 2]), torch.tensor([0.8, 1.0]))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    assert torch.isfinite(out[1]).sum() == 2


def test_sampling_frequencies_match_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    logits = probs.clamp_min(1e-30).log().expand(20000, -1)
    st = SamplingTensors.build([SamplingParams()] * 20000, 4, torch.device("cpu"))
    torch.manual_seed(0)
    tokens, logprobs = sample(logits, st, [None] * 20000)
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    assert torch.allclose(freq, probs, atol=0.015)
    torch.testing.assert_close(logprobs, probs.clamp_min(1e-30).log()[tokens])


def test_greedy_rows_take_argmax_in_a_mixed_batch():
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.0, 2.0, 1.9]])
    st = SamplingTensors.build([SamplingParams(greedy=True), SamplingParams(temperature=1.0)],
                               3, torch.device("cpu"))
    for _ in range(20):
        tokens, _ = sample(logits, st, [None, None])
        assert tokens[0] == 1
