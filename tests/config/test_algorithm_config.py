"""algorithm: settings that would do nothing under the chosen advantage or loss are load-time
errors saying what to change; dr_grpo is a preset that refuses a contradicting aggregation."""

from __future__ import annotations

import pytest

from fastdraft.config import dump_config, load_recipe
from fastdraft.config.sections import AlgorithmConfig


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.loss=grpo", "algorithm.clip_high=0.28"],
     r"algorithm\.clip_high does nothing with algorithm\.loss: grpo \(only loss dapo takes it\)"),
    (["algorithm.advantage=rloo", "algorithm.scale_std=false"],
     r"algorithm\.scale_std does nothing with algorithm\.advantage: rloo \(only advantage grpo "
     r"takes it\).*Dr\. GRPO is advantage: dr_grpo"),
    (["algorithm.advantage=dr_grpo", "algorithm.scale_std=false"],
     r"scale_std does nothing with algorithm\.advantage: dr_grpo"),
    (["algorithm.advantage=dr_grpo", "algorithm.aggregation=token-mean"],
     r"dr_grpo is defined with aggregation seq-mean-token-sum-norm; algorithm\.aggregation: "
     r"token-mean contradicts it"),
    (["algorithm.advantage=grpo_typo"], r"algorithm\.advantage: unknown advantage estimator"),
    (["algorithm.loss=ppo"], r"algorithm\.loss: unknown policy loss 'ppo'"),
    (["algorithm.aggregation=sum"], r"algorithm\.aggregation must be one of"),
])
def test_settings_that_do_nothing_or_contradict_fail_at_load(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_recipe(None, overrides)


@pytest.mark.parametrize("overrides", [
    ["algorithm.loss=dapo", "algorithm.clip_high=0.3"],
    ["algorithm.advantage=grpo", "algorithm.scale_std=false"],
    ["algorithm.advantage=dr_grpo", "algorithm.aggregation=seq-mean-token-sum-norm"],
    ["algorithm.advantage=dr_grpo", "algorithm.loss=dapo"],
])
def test_settings_that_act_load(overrides):
    load_recipe(None, overrides)


def test_unset_options_stay_unset_and_a_dumped_config_loads_back(tmp_path):
    cfg = load_recipe(None, ["algorithm.advantage=dr_grpo"])
    assert cfg.algorithm.scale_std is None and cfg.algorithm.clip_high is None
    assert cfg.algorithm.aggregation is None     # the preset applies in algo/objective.py
    dump_config(cfg, tmp_path / "config.yaml")
    assert load_recipe(tmp_path / "config.yaml") == cfg
    assert AlgorithmConfig().gate.law_z_threshold == 6.0
