"""Clipped surrogate, aggregation modes, k3 KL and gradients against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from fastdraft.algo.policy_loss import (
    PolicyBatch,
    aggregate,
    available_aggregations,
    available_policy_losses,
    finite_sequences,
    policy_loss,
    policy_loss_defaults,
    register_policy_loss,
)

NAN = float("nan")


def make_batch(**overrides: object) -> PolicyBatch:
    """The 2x3 example: old_logprobs = 0 on the mask, so ratio = exp(logprobs).

    Row 0, A = +1, ratios [1.5, 1.0, 0.5], all masked.
    Row 1, A = -2, ratios [0.5, 1.1, 3.0], last token off the mask (garbage NaN there).
    """
    ratios = torch.tensor([[1.5, 1.0, 0.5], [0.5, 1.1, 3.0]])
    logprobs = ratios.log()
    logprobs[1, 2] = NAN
    fields: dict[str, object] = {
        "logprobs": logprobs.requires_grad_(),
        "old_logprobs": torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, NAN]]),
        "advantages": torch.tensor([1.0, -2.0]),
        "mask": torch.tensor([[True, True, True], [True, True, False]]),
    }
    fields.update(overrides)
    return PolicyBatch(**fields)


# GRPO, clip_eps 0.2 -> ratio range [0.8, 1.2]; token loss = max(-r*A, -clip(r)*A):
#   row 0 (A=+1): r=1.5: max(-1.5, -1.2) = -1.2 (clip binds) ; r=1.0: -1.0 ;
#                 r=0.5: max(-0.5, -0.8) = -0.5 (outside the range, but the clip does not bind)
#                 sum = -2.7 over 3 tokens
#   row 1 (A=-2): r=0.5: max(1.0, 1.6) = 1.6 (clip binds) ; r=1.1: 2.2 ; sum = 3.8 over 2 tokens
@pytest.mark.parametrize(
    ("aggregation", "options", "expected"),
    [
        ("token-mean", {}, (-2.7 + 3.8) / 5),  # 0.22
        ("seq-mean-token-mean", {}, (-2.7 / 3 + 3.8 / 2) / 2),  # (-0.9 + 1.9) / 2 = 0.5
        ("seq-mean-token-sum-norm", {"max_tokens": 4}, (-2.7 / 4 + 3.8 / 4) / 2),  # 0.1375
        ("seq-mean-token-sum-norm", {}, (-2.7 / 3 + 3.8 / 3) / 2),  # default T = 3: 0.18333
    ],
)
def test_grpo_clipped_surrogate_per_aggregation(aggregation, options, expected) -> None:
    loss, metrics = policy_loss("grpo", make_batch(), aggregation=aggregation, **options)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["loss"] == pytest.approx(expected, rel=1e-6)
    assert metrics["pg_loss"] == pytest.approx(expected, rel=1e-6)
    assert metrics["clip_frac"] == pytest.approx(2 / 5)  # tokens (0,0) and (1,0)
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 1.0 + 0.5 + 0.5 + 1.1) / 5)  # 0.92
    assert metrics["kl"] == 0.0
    assert all(type(v) is float for v in metrics.values())


def test_grpo_default_aggregation_is_seq_mean_token_mean() -> None:
    loss, _ = policy_loss("grpo", make_batch())
    assert loss.item() == pytest.approx(0.5, rel=1e-6)


def test_dapo_clip_higher_and_token_mean_default() -> None:
    # range [0.8, 1.28]: row 0 r=1.5 -> max(-1.5, -1.28) = -1.28 ; row sums -2.78 and 3.8
    # token-mean: (-2.78 + 3.8) / 5 = 0.204
    loss, metrics = policy_loss("dapo", make_batch())
    assert loss.item() == pytest.approx(1.02 / 5, rel=1e-6)
    assert metrics["clip_frac"] == pytest.approx(2 / 5)


def test_clip_high_boundary_ratio_1_25() -> None:
    # one token, A = +1, ratio 1.25: DAPO's 1.28 does not clip (-1.25); GRPO's 1.2 does (-1.2)
    batch = PolicyBatch(
        logprobs=torch.tensor([[math.log(1.25)]]),
        old_logprobs=torch.zeros(1, 1),
        advantages=torch.tensor([1.0]),
        mask=torch.ones(1, 1, dtype=torch.bool),
    )
    dapo_loss, dapo_m = policy_loss("dapo", batch)
    grpo_loss, grpo_m = policy_loss("grpo", batch)
    assert dapo_loss.item() == pytest.approx(-1.25)
    assert dapo_m["clip_frac"] == 0.0
    assert grpo_loss.item() == pytest.approx(-1.2)
    assert grpo_m["clip_frac"] == 1.0


def test_gradients_hand_computed_and_zero_off_mask() -> None:
    # seq-mean-token-mean: d loss / d logp = -A * r / (n_tokens(row) * B) where the clip does
    # not bind, 0 where it binds or off the mask:
    #   (0,0) clipped 0 ; (0,1) -1*1.0/6 ; (0,2) -1*0.5/6
    #   (1,0) clipped 0 ; (1,1) 2*1.1/4 = 0.55 ; (1,2) off the mask 0
    batch = make_batch()
    loss, _ = policy_loss("grpo", batch)
    loss.backward()
    expected = torch.tensor([[0.0, -1 / 6, -1 / 12], [0.0, 0.55, 0.0]])
    assert torch.isfinite(batch.logprobs.grad).all()
    torch.testing.assert_close(batch.logprobs.grad, expected)


def test_k3_kl_value_penalty_and_gradient() -> None:
    # logp = 0, ref = [ln 2, -ln 2] -> d = ref - logp; k3 = e^d - d - 1:
    #   2 - ln2 - 1 = 0.30685 ; 0.5 + ln2 - 1 = 0.19315 ; mean = 0.5 / 2 = 0.25
    # A = 0, ratio 1 -> pg = 0; loss = 0.1 * 0.25 = 0.025 ; d k3 / d logp = 1 - e^d = [-1, 0.5]
    # gradient = 0.1 * [-1, 0.5] / 2 tokens = [-0.05, 0.025]
    logprobs = torch.zeros(1, 2, requires_grad=True)
    batch = PolicyBatch(
        logprobs=logprobs,
        old_logprobs=torch.zeros(1, 2),
        advantages=torch.zeros(1),
        mask=torch.ones(1, 2, dtype=torch.bool),
        ref_logprobs=torch.tensor([[math.log(2.0), -math.log(2.0)]]),
    )
    loss, metrics = policy_loss("grpo", batch, kl_coef=0.1)
    assert metrics["kl"] == pytest.approx(0.25, rel=1e-6)
    assert loss.item() == pytest.approx(0.025, rel=1e-6)
    assert metrics["pg_loss"] == 0.0
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.05, 0.025]]))
    # with kl_coef 0 the KL is still reported but not added
    loss, metrics = policy_loss("grpo", batch)
    assert loss.item() == 0.0
    assert metrics["kl"] == pytest.approx(0.25, rel=1e-6)


def test_sample_weight_skips_sequences() -> None:
    # weight [1, 0]: only row 0 counts -> -2.7 / 3 = -0.9 under both seq-mean and token-mean
    batch = make_batch(sample_weight=torch.tensor([1.0, 0.0]))
    for name, options in [("grpo", {}), ("dapo", {"clip_high": 0.2})]:
        loss, metrics = policy_loss(name, batch, **options)
        assert loss.item() == pytest.approx(-0.9, rel=1e-6)
        assert metrics["clip_frac"] == pytest.approx(1 / 3)  # only (0,0) among row 0's tokens


def test_all_skipped_gives_zero_loss_and_finite_grads() -> None:
    batch = make_batch(sample_weight=torch.zeros(2))
    for aggregation in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        loss, metrics = policy_loss("grpo", batch, aggregation=aggregation)
        assert loss.item() == 0.0
        assert metrics["clip_frac"] == 0.0
        loss.backward()
        assert torch.isfinite(batch.logprobs.grad).all()


def test_sequence_without_answer_tokens_contributes_nothing() -> None:
    # row 1 has no masked token (its NaN advantage is then allowed): only row 0, -2.7/3 = -0.9;
    # if the empty row counted as a sequence, seq-mean-token-mean would give -0.45
    mask = torch.tensor([[True, True, True], [False, False, False]])
    batch = make_batch(mask=mask, advantages=torch.tensor([1.0, NAN]))
    for aggregation in ("token-mean", "seq-mean-token-mean"):
        loss, _ = policy_loss("grpo", batch, aggregation=aggregation)
        assert loss.item() == pytest.approx(-0.9, rel=1e-6)


def test_aggregate_directly() -> None:
    values = torch.tensor([[1.0, 2.0, NAN], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert aggregate("token-mean", values, mask).item() == pytest.approx(7 / 3)  # (1+2+4)/3
    assert aggregate("seq-mean-token-mean", values, mask).item() == pytest.approx(2.75)  # 1.5, 4
    got = aggregate("seq-mean-token-sum-norm", values, mask, max_tokens=2)
    assert got.item() == pytest.approx(1.75)  # (3/2 + 4/2) / 2


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"logprobs": torch.tensor([[NAN, 0.0, 0.0], [0.0, 0.0, 0.0]])}, "logprobs has NaN"),
        ({"old_logprobs": torch.tensor([[0.0, math.inf, 0.0], [0.0, 0.0, 0.0]])}, "old_logprobs"),
        ({"advantages": torch.tensor([1.0, math.inf])}, "advantages have NaN"),
        ({"advantages": torch.tensor([1.0, 2.0, 3.0])}, "advantages has shape"),
        ({"mask": torch.ones(2, 3)}, "bool"),
        ({"sample_weight": torch.tensor([1.0, -1.0])}, "sample_weight"),
    ],
)
def test_batch_validation(overrides, match) -> None:
    with pytest.raises(ValueError, match=match):
        make_batch(**overrides)


@pytest.mark.parametrize(
    ("name", "options", "match"),
    [
        ("ppo", {}, r"unknown policy loss 'ppo'.*dapo.*grpo"),
        ("grpo", {"clip_high": 0.3}, "unknown options"),
        ("grpo", {"aggregation": "sum"}, "unknown aggregation"),
        ("grpo", {"aggregation": "token-mean", "max_tokens": 8}, "max_tokens"),
        ("grpo", {"kl_coef": 0.1}, "ref_logprobs"),
        ("dapo", {"clip_low": 1.0}, "clip range"),
    ],
)
def test_option_errors(name, options, match) -> None:
    with pytest.raises(ValueError, match=match):
        policy_loss(name, make_batch(), **options)


def test_finite_sequences_judge_masked_tokens_and_advantages() -> None:
    mask = torch.tensor([[True, True, False], [True, True, True], [True, False, False],
                         [False, False, False]])
    old = torch.tensor([[0.0, 0.0, NAN], [0.0, math.inf, 0.0], [0.0, 0.0, 0.0], [NAN] * 3])
    new = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [NAN, 0.0, 0.0], [0.0] * 3])
    advantages = torch.tensor([1.0, 1.0, 1.0, NAN])
    assert finite_sequences(mask, advantages, old, new, None).tolist() == [
        True, False, False, False]   # NaN off the mask (row 0) does not count
    # the batch built from the finite rows alone passes PolicyBatch's strict checks
    keep = mask & finite_sequences(mask, advantages, old, new).unsqueeze(1)
    PolicyBatch(logprobs=new, old_logprobs=old, advantages=advantages, mask=keep)


def test_loss_options_and_aggregations_are_listed() -> None:
    assert policy_loss_defaults("dapo")["clip_high"] == 0.28
    assert policy_loss_defaults("dapo")["aggregation"] == "token-mean"
    assert "clip_high" not in policy_loss_defaults("grpo")
    assert available_aggregations() == ["seq-mean-token-mean", "seq-mean-token-sum-norm",
                                        "token-mean"]


def test_registry() -> None:
    assert {"grpo", "dapo"} <= set(available_policy_losses())
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("grpo")(lambda batch: (batch, {}))
