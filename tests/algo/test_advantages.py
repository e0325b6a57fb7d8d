"""Advantage estimators against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from fastdraft.algo.advantages import (
    advantage_aggregation,
    advantage_defaults,
    available_advantages,
    compute_advantages,
    register_advantage,
    zero_variance_groups,
)


def test_grpo_uses_unbiased_std_and_groups_are_group_major() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    # group 0 = [1,0,0,1]: mean 0.5, deviations +-0.5, unbiased var = 4 * 0.25 / 3 = 1/3,
    # std = 0.57735, adv = 0.5 / (0.57735 + 1e-6) = 0.866024 (population std would give 1.0)
    # group 1 = [1,1,1,1]: deviations 0 -> adv 0 / (0 + 1e-6) = 0
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    expected = torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0])
    got = compute_advantages("grpo", rewards, group_size=4)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_grpo_two_per_group() -> None:
    # [1,0] -> mean 0.5, unbiased std = sqrt(0.5) = 0.70711 -> +-0.5/0.70711 = +-0.70711
    # [0,0] -> 0. Read sample-major (prompt 0 = positions 0 and 2) it would be [a, 0, -a, 0].
    got = compute_advantages("grpo", torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=2)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(got, torch.tensor([a, -a, 0.0, 0.0]))


def test_dr_grpo_only_subtracts_the_mean() -> None:
    # [1,0,0,1] - mean 0.5 = [.5,-.5,-.5,.5] ; [3,1,1,3] - mean 2 = [1,-1,-1,1] (no division)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 1.0, 3.0])
    got = compute_advantages("grpo", rewards, group_size=4, scale_std=False)
    torch.testing.assert_close(got, torch.tensor([0.5, -0.5, -0.5, 0.5, 1.0, -1.0, -1.0, 1.0]))


def test_dr_grpo_is_registered_with_its_length_unbiased_aggregation() -> None:
    # mean only, no std option (it would do nothing), and the aggregation it is defined with
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 1.0, 3.0])
    got = compute_advantages("dr_grpo", rewards, group_size=4)
    torch.testing.assert_close(got, torch.tensor([0.5, -0.5, -0.5, 0.5, 1.0, -1.0, -1.0, 1.0]))
    assert advantage_defaults("dr_grpo") == {}
    assert advantage_aggregation("dr_grpo") == "seq-mean-token-sum-norm"
    assert advantage_defaults("grpo") == {"scale_std": True}
    assert advantage_aggregation("grpo") is None and advantage_aggregation("rloo") is None


def test_rloo_leave_one_out() -> None:
    # [1,0,0]: 1 - mean(0,0) = 1 ; 0 - mean(1,0) = -0.5 ; 0 - mean(1,0) = -0.5
    # G=2, [2,4] and [1,1]: 2 - 4 = -2 ; 4 - 2 = 2 ; 1 - 1 = 0 ; 0
    got = compute_advantages("rloo", torch.tensor([1.0, 0.0, 0.0]), group_size=3)
    torch.testing.assert_close(got, torch.tensor([1.0, -0.5, -0.5]))
    got = compute_advantages("rloo", torch.tensor([2.0, 4.0, 1.0, 1.0]), group_size=2)
    torch.testing.assert_close(got, torch.tensor([-2.0, 2.0, 0.0, 0.0]))


def test_integer_and_bool_rewards_are_accepted() -> None:
    got = compute_advantages("rloo", torch.tensor([True, False, False]), group_size=3)
    torch.testing.assert_close(got, torch.tensor([1.0, -0.5, -0.5]))


def test_zero_variance_groups() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    got = zero_variance_groups(rewards, group_size=4)
    assert got.dtype == torch.bool
    assert got.tolist() == [False, True, True]


@pytest.mark.parametrize(
    ("name", "rewards", "group_size", "options", "match"),
    [
        ("grpo", [1.0, 0.0, 1.0], 2, {}, "multiple of group_size"),
        ("nope", [1.0, 0.0], 2, {}, r"unknown advantage estimator 'nope'.*grpo.*rloo"),
        ("grpo", [1.0, float("nan")], 2, {}, "NaN"),
        ("rloo", [1.0, 0.0], 1, {}, "group_size >= 2"),
        ("grpo", [1.0, 0.0], 1, {}, "group_size >= 2"),
        ("grpo", [1.0, 0.0], 2, {"scale": True}, "unknown options"),
        ("grpo", [1.0, 0.0], 0, {}, "group_size=0"),
    ],
)
def test_user_errors(name, rewards, group_size, options, match) -> None:
    with pytest.raises(ValueError, match=match):
        compute_advantages(name, torch.tensor(rewards), group_size, **options)


def test_zero_variance_groups_rejects_bad_size() -> None:
    with pytest.raises(ValueError, match="multiple of group_size"):
        zero_variance_groups(torch.tensor([1.0, 0.0, 1.0]), group_size=2)


def test_registry() -> None:
    assert {"grpo", "dr_grpo", "rloo"} <= set(available_advantages())
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda grouped: grouped)
    with pytest.raises(ValueError, match="already registered"):   # and no preset leaks in
        register_advantage("rloo", aggregation="token-mean")(lambda grouped: grouped)
    assert advantage_aggregation("rloo") is None
