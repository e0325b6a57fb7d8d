"""The lossless gate's limits follow both sides' dtypes; its robust statistics ignore rounding
outliers but catch a systematic shift, a heavy tail and one gross break; the law statistic
joins in when the actor gives entropies; non-finite sequences are left out, not fatal."""

from __future__ import annotations

import pytest
import torch

from fastdraft.algo.gate import GateTolerance, LosslessGateError, check_gate
from fastdraft.algo.token_stats import TokenStats, token_stats
from fastdraft.config import load_recipe
from fastdraft.config.sections import GateSection

FP32 = GateTolerance.for_dtypes("float32", "float32")
BF16 = GateTolerance.for_dtypes("bfloat16", "bfloat16")


def test_the_coarser_of_the_serving_and_compute_dtypes_sets_the_limits():
    assert FP32.mean <= 1e-3 and FP32.max <= 0.1
    # fp32 masters + bf16 compute (the engine serving fp32 or bf16): bf16 rules, either side
    for serve, compute in [("float32", "bfloat16"), ("bfloat16", "float32"),
                           ("float16", "bfloat16")]:
        assert GateTolerance.for_dtypes(serve, compute) == BF16
    fp16 = GateTolerance.for_dtypes("float16", "float32")
    assert FP32.mean < fp16.mean < BF16.mean and FP32.max < fp16.max < BF16.max
    # the 0.5 nats fp32-masters-vs-bf16-compute gap passes every bf16 limit but the mean's
    assert BF16.max > 0.5 and BF16.quantile_diff >= 0.5
    with pytest.raises(ValueError, match="no gate tolerance for dtype 'int8'"):
        GateTolerance.for_dtypes("int8", "float32")


def test_the_recipe_section_overrides_what_it_sets():
    cfg = load_recipe(None, ["algorithm.gate.max_tolerance=0.3", "algorithm.gate.quantile=0.999",
                             "model.dtype=bfloat16"])
    tol = GateTolerance.for_dtypes(cfg.model.dtype, cfg.actor.compute_dtype, cfg.algorithm.gate)
    assert tol.max == 0.3 and tol.quantile == 0.999
    assert tol.mean == BF16.mean and tol.quantile_diff == BF16.quantile_diff
    assert GateTolerance.for_dtypes("float32", "float32",
                                    GateSection(law_z_threshold=None)).law_z is None
    with pytest.raises(ValueError, match=r"algorithm\.gate\.quantile must be in \[0\.5, 1\)"):
        load_recipe(None, ["algorithm.gate.quantile=1.0"])
    with pytest.raises(ValueError, match=r"algorithm\.gate\.mean_tolerance must be > 0"):
        load_recipe(None, ["algorithm.gate.mean_tolerance=0"])
    with pytest.raises(ValueError, match=r"algorithm\.gate\.max_share must be in \[0, 1\)"):
        load_recipe(None, ["algorithm.gate.max_share=1.5"])
    cfg = load_recipe(None, ["algorithm.gate.max_share=0.01", "model.dtype=bfloat16"])
    assert GateTolerance.for_dtypes("bfloat16", "float32", cfg.algorithm.gate).max_share == 0.01
    assert BF16.max_share == 1e-3 and FP32.max_share == 0.0


def test_the_removed_tolerance_key_names_the_gate_section():
    with pytest.raises(ValueError, match=r"logprob_tolerance' was removed: .*algorithm\.gate"):
        load_recipe(None, ["algorithm.logprob_tolerance=0.1"])


def _rollout(rows: int = 200, cols: int = 500, seed: int = 0):
    """Engine logprobs and a mask; the actor's are the engine's + `noise` (set by each test)."""
    gen = torch.Generator().manual_seed(seed)
    engine = -torch.rand(rows, cols, generator=gen) * 3
    mask = torch.ones(rows, cols, dtype=torch.bool)
    mask[:, :20] = False                                   # prompt columns
    noise = torch.randn(rows, cols, generator=gen) * 0.01  # bf16-like rounding, typical token
    return engine, mask, noise


def test_a_few_rounding_outliers_among_many_bf16_tokens_pass():
    engine, mask, noise = _rollout()
    noise.view(-1)[torch.randperm(noise.numel())[:30]] = 1.5   # 30 of 100k tokens off by 1.5
    metrics = check_gate(TokenStats(engine + noise), engine, mask, BF16)
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(1.5, abs=1e-5)
    assert metrics["rollout/logprob_diff_p99"] < 0.05
    assert "rollout/law_z" not in metrics               # no entropies given: no law check


def test_a_systematic_shift_of_the_mean_trips_the_gate():
    engine, mask, noise = _rollout()
    with pytest.raises(LosslessGateError,
                       match=r"the mean per-token \|logprob diff\| is 0\.\d+ \(> 0\.05\)"):
        check_gate(TokenStats(engine + noise + 0.1), engine, mask, BF16)


def test_a_heavy_tail_trips_the_quantile():
    engine, mask, noise = _rollout()
    tail = torch.rand(noise.shape, generator=torch.Generator().manual_seed(1)) < 0.03
    noise[tail] = 0.8                          # 3% of tokens off by 0.8: mean ~0.03, p99 0.8
    with pytest.raises(LosslessGateError, match=r"the 0\.99 quantile of the \|logprob diff\|"):
        check_gate(TokenStats(engine + noise), engine, mask, BF16)


def test_one_gross_diff_fails_fp32_and_fp16_and_names_the_token():
    engine, mask, noise = _rollout()
    noise *= 1e-3                              # fp32 rounding
    noise[7, 45] = 6.0                         # a wrong tensor: nats, on one token
    fp16 = GateTolerance.for_dtypes("float16", "float16")
    for tolerance in (FP32, fp16):
        with pytest.raises(LosslessGateError) as err:
            check_gate(TokenStats(engine + noise), engine, mask, tolerance)
        text = str(err.value)
        assert "its largest per-token |logprob diff| is 6 (> " in text
        assert "1 of them exceed" in text and "none may" in text
        assert "sample 7's answer token 25 of 480 (column 45)" in text  # answer: columns 20-499
        assert "differs from the actor's" in text and "rollout.spec.method=none" in text
    noise[7, 45] = 0.5                         # in fp32 half a nat is no rounding either
    assert check_gate(TokenStats(engine + noise), engine, mask, BF16)[
        "rollout/logprob_diff_max"] > 0.4
    with pytest.raises(LosslessGateError, match="largest per-token"):
        check_gate(TokenStats(engine + noise), engine, mask, FP32)


def test_bf16_passes_isolated_rounding_outliers_of_nats_and_fails_a_share_of_them():
    """A policy sharpened by RL, the same weights in bf16 and fp32, differs by up to 8 nats at
    ~3 in 10k tokens (algo/gate.py): a bf16 gate that failed one such token stopped a healthy run.
    More than max_share of the tokens beyond max is no rounding."""
    engine, mask, noise = _rollout()           # 96k answer tokens
    answers = mask.view(-1).nonzero()[:, 0]
    spots = answers[torch.randperm(len(answers), generator=torch.Generator().manual_seed(2))]
    noise.view(-1)[spots[:30]] = 6.0           # 3 in 10k, as measured
    metrics = check_gate(TokenStats(engine + noise), engine, mask, BF16)
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(6.0)
    assert metrics["rollout/logprob_diff_beyond_max"] == 30
    noise.view(-1)[spots[:200]] = 6.0          # 2 in 1000: beyond the 1e-3 share
    with pytest.raises(LosslessGateError, match=r"200 of them exceed 4 nats, at most a share "
                                                r"of 0\.001 may"):
        check_gate(TokenStats(engine + noise), engine, mask, BF16)
    strict = GateTolerance.for_dtypes("bfloat16", "bfloat16", GateSection(max_share=0.0))
    noise.view(-1)[spots[1:200]] = 0.0
    with pytest.raises(LosslessGateError, match="1 of them exceed 4 nats, none may"):
        check_gate(TokenStats(engine + noise), engine, mask, strict)


def test_a_non_finite_sequence_is_left_out_and_counted_an_all_non_finite_batch_fails():
    engine, mask, noise = _rollout(rows=4, cols=50)
    actor = engine + noise * 0.01
    actor[1, 30] = float("nan")
    engine[2, 40] = float("inf")
    engine[3, 5] = float("nan")                # off the mask: not a problem
    metrics = check_gate(TokenStats(actor), engine, mask, FP32)
    assert metrics["rollout/gate_nonfinite_sequences"] == 2.0
    assert metrics["rollout/logprob_diff_max"] < 1e-3
    actor[[0, 3], 25] = float("nan")
    with pytest.raises(LosslessGateError, match="every sequence has a non-finite logprob"):
        check_gate(TokenStats(actor), engine, mask, FP32)


def _law_batch(sharpen: float, rows: int = 40, cols: int = 60, vocab: int = 12):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(rows, cols, vocab, generator=gen) * 2
    draws = torch.multinomial((logits.view(-1, vocab) * sharpen).softmax(-1), 1,
                              generator=gen).view(rows, cols)
    stats = token_stats(logits, draws, 1.0)
    return stats, stats.logprob.clone(), torch.ones(rows, cols, dtype=torch.bool)


def test_the_law_statistic_passes_the_policys_samples_and_trips_a_sharper_law():
    stats, engine, mask = _law_batch(1.0)
    metrics = check_gate(stats, engine, mask, FP32)
    assert abs(metrics["rollout/law_z"]) < 4 and metrics["rollout/law_tokens"] == 2400
    stats, engine, mask = _law_batch(1.6)      # every token's logprob still agrees exactly
    with pytest.raises(LosslessGateError, match=r"not drawn from the policy's law: z = -\d+"):
        check_gate(stats, engine, mask, FP32)
    off = GateTolerance.for_dtypes("float32", "float32", GateSection(law_z_threshold=None))
    assert "rollout/law_z" not in check_gate(stats, engine, mask, off)
    few = GateTolerance.for_dtypes("float32", "float32", GateSection(law_min_tokens=10_000))
    assert check_gate(stats, engine, mask, few)["rollout/law_z"] < -6   # reported, not judged
