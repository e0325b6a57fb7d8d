"""The law check scales with the step: it bounds the per-token bias b = mean(-log p(x) - H) in
nats, with an interval of law_z_threshold standard errors, against a tolerance the dtypes'
rounding explains, rather than judging a z that grows with sqrt(tokens). A correct bf16 run's
small systematic rounding bias passes at 5 M tokens (where |z| > 6 would have stopped it); a
wrong sampler's bias still fails at 5 M and at 10^4 tokens; a few thousand tokens are judged as
by |z| > 6.

The gate sees only the actor's TokenStats (sample_logprob, entropy, variance per token) and the
engine's logprobs, so the large batches are built directly: surprise = H + bias + sqrt(Var) *
noise, the law statistic's own model of a token (no model, no vocabulary)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from fastdraft.algo.gate import LAW_BIAS_TOLERANCE, GateTolerance, LosslessGateError, check_gate
from fastdraft.algo.token_stats import TokenStats, law_statistic
from fastdraft.config import load_recipe
from fastdraft.config.sections import GateSection
from tests.algo.test_gate import _law_batch

FP32 = GateTolerance.for_dtypes("float32", "float32")
BF16 = GateTolerance.for_dtypes("bfloat16", "float32")     # bf16 compute: the bf16 rules
BF16_ROUNDING_BIAS = 0.005                                  # nats a token, systematic
REAL_SIZE = (1000, 5000)                                    # 5 M answer tokens a step


@pytest.fixture(scope="module")
def noise():
    """Per-token entropies (0.2-3 nats), variances (0.5-1.5 nat^2, mean 1) and standard normal
    noise for 5 M tokens, drawn once."""
    gen = torch.Generator().manual_seed(11)
    entropy = torch.rand(REAL_SIZE, generator=gen) * 2.8 + 0.2
    variance = torch.rand(REAL_SIZE, generator=gen) + 0.5
    return entropy, variance, torch.randn(REAL_SIZE, generator=gen)


def _batch(noise, bias: float, shape: tuple[int, int] | None = None):
    """TokenStats whose surprise exceeds the entropy by `bias` a token on average (plus the
    law's own noise), the engine's logprobs off by bf16-sized per-token rounding (~0.01 nats),
    and an all-true mask; `shape`: the leading corner of the 5 M tokens."""
    entropy, variance, eps = noise
    if shape is not None:
        entropy, variance, eps = (t[:shape[0], :shape[1]] for t in (entropy, variance, eps))
    logprob = -(entropy + bias + variance.sqrt() * eps)
    engine = logprob + 0.01 * eps.roll(1, dims=1)          # any small per-token difference
    stats = TokenStats(logprob, logprob, entropy, variance)
    return stats, engine, torch.ones(logprob.shape, dtype=torch.bool)


def test_a_bf16_rounding_bias_passes_at_real_size_where_a_fixed_z_limit_stopped_it(noise):
    stats, engine, mask = _batch(noise, BF16_ROUNDING_BIAS)
    metrics = check_gate(stats, engine, mask, BF16)
    assert metrics["rollout/law_tokens"] == 5_000_000
    # the bias is measured in nats, to within its interval (6 standard errors, ~0.0027 here)...
    bias, ci = metrics["rollout/law_bias"], metrics["rollout/law_bias_ci"]
    assert abs(bias - BF16_ROUNDING_BIAS) < ci < 0.003
    # ...while z grows with sqrt(tokens): |z| > 6, what the old rule (a fixed |z| limit) failed
    assert metrics["rollout/law_z"] > 6
    with pytest.raises(LosslessGateError, match="not drawn from the policy's law"):
        check_gate(stats, engine, mask, replace(BF16, law_bias=0.0))     # the old rule
    # fp32 on both sides has no such rounding: the same bias is confidently beyond its 1e-3
    with pytest.raises(LosslessGateError, match="not drawn from the policy's law"):
        check_gate(stats, stats.logprob, mask, FP32)     # (fp32's per-token diffs: ~0)


def test_a_wrong_samplers_bias_still_fails_at_real_size(noise):
    """A share f of tokens from a flatter (or sharper) drafter: b = f * (E_q[-log p] - H(p)),
    >= 0.05 nats a token. The message states the bias, its interval, the tolerance, the token
    count and what to check."""
    stats, engine, mask = _batch(noise, 0.05)
    with pytest.raises(LosslessGateError) as caught:
        check_gate(stats, engine, mask, BF16)
    message = str(caught.value)
    assert caught.match(r"a bias of \+0\.0[45]\d\d \+- 0\.00\d\d nats a token \(6 standard "
                        r"errors\), beyond the tolerance of 0\.02 nats a token")
    assert "over 5000000 tokens" in message and "flatter than the policy" in message
    for hint in ("engine/spec/accept.py", "rollout.spec.method=none drafter.online.enabled=false",
                 "algorithm.gate.law_bias_tolerance"):
        assert hint in message


@pytest.mark.parametrize("bias", [0.1, -0.1])
def test_a_wrong_samplers_bias_fails_at_ten_thousand_tokens(noise, bias):
    stats, engine, mask = _batch(noise, bias, (10, 1000))
    with pytest.raises(LosslessGateError, match="over 10000 tokens, a bias of") as caught:
        check_gate(stats, engine, mask, BF16)
    assert ("sharper" if bias < 0 else "flatter") + " than the policy" in str(caught.value)
    # at 10^4 tokens the interval (~0.06 nats) dominates the tolerance: the exact law passes
    metrics = check_gate(*_batch(noise, 0.0, (10, 1000)), BF16)
    assert 0.05 < metrics["rollout/law_bias_ci"] < 0.07 and abs(metrics["rollout/law_z"]) < 4


def test_the_rule_is_a_z_limit_raised_by_tolerance_over_se(noise):
    """Fail exactly when |b| - k se > tolerance, i.e. |z| > k + tolerance / se: biases on both
    sides of the boundary, at 2000 tokens."""
    shape = (2, 1000)
    exact = law_statistic(_batch(noise, 0.0, shape)[0], torch.ones(shape, dtype=torch.bool))
    for tol in (FP32, BF16):
        edge = tol.law_bias + tol.law_z * exact.se     # |b| at the boundary
        for sign in (1, -1):
            for bias in (edge * 0.97, edge * 1.03):     # shifted to measure sign * bias
                stats, _, mask = _batch(noise, sign * bias - exact.bias, shape)
                engine = stats.logprob                  # no per-token diffs (fp32's limits)
                law = law_statistic(stats, mask)
                fails = abs(law.z) > tol.law_z + tol.law_bias / law.se
                assert fails == (bias > edge)
                if fails:
                    with pytest.raises(LosslessGateError):
                        check_gate(stats, engine, mask, tol)
                else:
                    check_gate(stats, engine, mask, tol)


def test_at_a_few_thousand_tokens_the_rule_is_todays():
    stats, engine, mask = _law_batch(1.6)
    law = law_statistic(stats, mask)
    for tol in (FP32, BF16):
        # the effective |z| limit, k + tolerance / se, stays near 6 at this size
        assert 6 < tol.law_z + tol.law_bias / law.se < (6.1 if tol is FP32 else 7.5)
        with pytest.raises(LosslessGateError, match=r"not drawn from the policy's law: z = -\d+"):
            check_gate(stats, engine, mask, tol)
    metrics = check_gate(*_law_batch(1.0), BF16)              # the policy's own samples
    assert abs(metrics["rollout/law_z"]) < 4 and metrics["rollout/law_bias_ci"] > 0.1


def test_the_bias_tolerance_follows_the_coarser_dtype_and_the_recipe():
    assert LAW_BIAS_TOLERANCE == {"float32": 1e-3, "float16": 0.01, "bfloat16": 0.02}
    assert FP32.law_bias == 1e-3 and BF16.law_bias == 0.02
    assert GateTolerance.for_dtypes("float16", "float32").law_bias == 0.01
    assert GateTolerance.for_dtypes("float16", "bfloat16").law_bias == 0.02
    assert FP32.law_z == BF16.law_z == 6.0             # law_z_threshold: standard errors
    cfg = load_recipe(None, ["algorithm.gate.law_bias_tolerance=0.1",
                             "algorithm.gate.law_z_threshold=4", "model.dtype=bfloat16"])
    tol = GateTolerance.for_dtypes(cfg.model.dtype, cfg.actor.compute_dtype, cfg.algorithm.gate)
    assert tol.law_bias == 0.1 and tol.law_z == 4.0
    assert GateTolerance.for_dtypes("float32", "float32",
                                    GateSection(law_bias_tolerance=0.5)).law_bias == 0.5
    for bad in ("0", "-0.01"):
        with pytest.raises(ValueError, match=r"algorithm\.gate\.law_bias_tolerance must be > 0"):
            load_recipe(None, [f"algorithm.gate.law_bias_tolerance={bad}"])


def test_a_raised_tolerance_is_honoured(noise):
    stats, engine, mask = _batch(noise, 0.05, (100, 1000))
    with pytest.raises(LosslessGateError, match=r"tolerance of 0\.02 nats"):
        check_gate(stats, engine, mask, BF16)
    loose = GateTolerance.for_dtypes("bfloat16", "float32", GateSection(law_bias_tolerance=0.1))
    metrics = check_gate(stats, engine, mask, loose)
    assert math.isclose(metrics["rollout/law_bias"], 0.05, abs_tol=metrics["rollout/law_bias_ci"])
