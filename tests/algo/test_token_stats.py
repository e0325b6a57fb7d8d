"""Per-token statistics of the sampling law against direct computation, and the law statistic on
exact and biased samples of small categoricals."""

from __future__ import annotations

import pytest
import torch

from fastdraft.algo import token_stats as token_stats_mod
from fastdraft.algo.token_stats import TokenStats, law_statistic, token_stats
from fastdraft.engine.sampler import filter_top_k_top_p


def _direct(logits, targets, temperature, top_p=1.0, top_k=-1):
    """The same quantities the slow, obvious way, in float64."""
    scaled = logits.double() / temperature
    flat = scaled.reshape(-1, scaled.shape[-1])
    k = flat.shape[-1] if top_k < 0 else top_k
    filtered = filter_top_k_top_p(flat, torch.full((flat.shape[0],), k),
                                  torch.full((flat.shape[0],), top_p, dtype=torch.float64))
    p = filtered.softmax(-1)
    logp = filtered.log_softmax(-1)
    plogp = torch.where(p > 0, p * logp, torch.zeros_like(p))
    entropy = -plogp.sum(-1)
    second = torch.where(p > 0, p * logp.square(), torch.zeros_like(p)).sum(-1)
    t = targets.reshape(-1, 1)
    shape = targets.shape
    return (flat.log_softmax(-1).gather(-1, t).view(shape), logp.gather(-1, t).view(shape),
            entropy.view(shape), (second - entropy.square()).view(shape))


@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 1.0, -1), (0.7, 0.8, -1),
                                                       (1.3, 1.0, 5), (0.9, 0.9, 7)])
def test_token_stats_match_the_direct_computation(temperature, top_p, top_k, monkeypatch):
    torch.manual_seed(0)
    logits = torch.randn(3, 9, 16) * 3
    # targets drawn from the sampling law, so sample_logprob is finite (a token the filter
    # drops has -inf: tested below)
    probs = filter_top_k_top_p(logits.view(-1, 16) / temperature,
                               torch.full((27,), 16 if top_k < 0 else top_k),
                               torch.full((27,), top_p)).softmax(-1)
    targets = torch.multinomial(probs, 1).view(3, 9)
    monkeypatch.setattr(token_stats_mod, "CHUNK_BYTES", 5 * 16 * 4)   # 5 positions a chunk
    got = token_stats(logits, targets, temperature, top_p, top_k)
    for have, want in zip(got, _direct(logits, targets, temperature, top_p, top_k)):
        torch.testing.assert_close(have.double(), want, atol=2e-5, rtol=1e-5)
    if top_p == 1.0 and top_k < 0:   # nothing filters: the sampling law is the policy's own
        torch.testing.assert_close(got.sample_logprob, got.logprob, atol=1e-5, rtol=0)


def test_token_stats_read_strided_bf16_logits_only_where_masked():
    torch.manual_seed(1)
    full = torch.randn(2, 7, 12, dtype=torch.bfloat16)
    logits = full[:, :-1]                                # a view, as the actor passes it
    targets = torch.randint(0, 12, (2, 6))
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, 2:] = True
    mask[1, :3] = True
    got = token_stats(logits, targets, 1.0, mask=mask)
    want = _direct(logits.float(), targets, 1.0)
    for have, ref in zip(got, want):
        torch.testing.assert_close(have[mask].double(), ref[mask], atol=1e-5, rtol=1e-5)
        assert (have[~mask] == 0).all()


def test_a_target_outside_the_nucleus_has_no_sample_logprob_and_is_left_out_of_z():
    logits = torch.tensor([[[4.0, 3.0, -5.0, -6.0]]]).expand(1, 200, 4).clone()
    targets = torch.zeros(1, 200, dtype=torch.long)
    targets[0, 0] = 3                                    # top_k=2 never samples token 3
    stats = token_stats(logits, targets, 1.0, top_k=2)
    assert stats.sample_logprob[0, 0] == float("-inf") and torch.isfinite(stats.logprob).all()
    law = law_statistic(stats, torch.ones(1, 200, dtype=torch.bool))
    assert law.outside == 1 and law.tokens == 199


def _z_of_samples(seed: int, sharpen: float, tokens: int = 4000, vocab: int = 16) -> float:
    """Targets drawn from softmax(sharpen * logits), judged against softmax(logits)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, tokens, vocab, generator=gen) * 1.5
    draws = torch.multinomial((logits[0] * sharpen).softmax(-1), 1, generator=gen).view(1, -1)
    stats = token_stats(logits, draws, 1.0)
    return law_statistic(stats, torch.ones(1, tokens, dtype=torch.bool)).z


def test_the_law_statistic_of_exact_samples_is_standard_normal():
    zs = [_z_of_samples(seed, 1.0) for seed in range(8)]
    assert max(abs(z) for z in zs) < 4.0      # each ~N(0, 1): P(|z| > 4) ~ 6e-5
    assert abs(sum(zs) / len(zs) ** 0.5) < 4.0


@pytest.mark.parametrize("sharpen, sign", [(1.5, -1), (0.6, 1)])
def test_samples_from_another_law_push_z_past_the_threshold(sharpen, sign):
    """Sharper than the policy (a verifier over-accepting sharp drafts): z strongly negative;
    flatter: strongly positive."""
    for seed in range(3):
        assert sign * _z_of_samples(seed, sharpen) > 6.0


def test_the_law_needs_entropies():
    with pytest.raises(ValueError, match="law statistic needs"):
        law_statistic(TokenStats(logprob=torch.zeros(1, 3)), torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="T > 0"):
        token_stats(torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long), 0.0)
