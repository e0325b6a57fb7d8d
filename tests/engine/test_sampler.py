from __future__ import annotations

import torch

from fastdraft.engine.sampler import SamplingTensors, filter_top_k_top_p, inverse_cdf, sample
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
    uniforms = torch.rand(20000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tokens, logprobs = sample(logits, st, uniforms)
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    assert torch.allclose(freq, probs, atol=0.015)
    torch.testing.assert_close(logprobs, probs.clamp_min(1e-30).log()[tokens])


def test_greedy_rows_take_argmax_in_a_mixed_batch():
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.0, 2.0, 1.9]])
    st = SamplingTensors.build([SamplingParams(greedy=True), SamplingParams(temperature=1.0)],
                               3, torch.device("cpu"))
    for u in torch.linspace(0, 0.999, 20, dtype=torch.float64):
        tokens, _ = sample(logits, st, u.expand(2))
        assert tokens[0] == 1


def test_inverse_cdf_never_draws_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(5, -1)
    edges = torch.tensor([0.0, 0.4999999, 0.5, 0.9999999, 1 - 2 ** -53], dtype=torch.float64)
    assert inverse_cdf(probs, edges).tolist() == [1, 1, 3, 3, 3]


def test_a_top_p_1_row_keeps_its_tail_beside_a_filtering_row():
    """Its law must not depend on its batch: rounding can make the cumulative mass reach 1
    before the last token, and a row with top_p = 1 must still keep every token."""
    logits = torch.tensor([[30.0, 0.0, -5.0, -80.0], [30.0, 0.0, -5.0, -80.0]])
    out = filter_top_k_top_p(logits, torch.tensor([4, 4]), torch.tensor([1.0, 0.5]))
    assert torch.isfinite(out[0]).all()
    assert torch.isfinite(out[1]).tolist() == [True, False, False, False]
