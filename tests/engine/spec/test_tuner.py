"""BEG-MAB tuner: converges on stationary rewards, re-adapts when they shift, explores every
bucket with several arms, plays the prior until it has data, and resumes its state exactly."""

import json
import random

import pytest

from fastdraft.config.engine import OFF, SpecConfig, TunerBucket, TunerConfig, arm_name, parse_arm
from fastdraft.engine.spec.tuner import SpecTuner, check_tuner

EAGLE = SpecConfig(method="eagle", depth=6, topk=3, tokens_to_verify=12)


def _arms(*names: str) -> tuple[SpecConfig, ...]:
    return tuple(parse_arm(n) for n in names)


def _config(**kwargs) -> TunerConfig:
    return TunerConfig(buckets=(
        TunerBucket(min_batch=1, arms=_arms("eagle/6/3/12", "eagle/4/3/6", "off")),
        TunerBucket(min_batch=16, arms=_arms("off", "eagle/3/2/4"))), **kwargs)


def _play(tuner: SpecTuner, true_rate: dict[str, float], steps: int, batch: int,
          noise: random.Random) -> dict[str, int]:
    chosen: dict[str, int] = {}
    for _ in range(steps):
        arm = tuner.select(batch)
        name = arm_name(arm)
        chosen[name] = chosen.get(name, 0) + 1
        tokens = max(1, round(true_rate[name] * noise.uniform(0.7, 1.3)))
        tuner.record(arm, tokens, batch, 1.0)
    return chosen


def test_arm_names_round_trip_and_bad_names_say_what_to_write():
    for arm in (OFF, EAGLE, SpecConfig(method="suffix", depth=8, topk=1, tokens_to_verify=8)):
        assert parse_arm(arm_name(arm)) == arm
    with pytest.raises(ValueError, match="method/depth/topk/tokens_to_verify"):
        parse_arm("eagle/6/x")


def test_converges_to_the_best_arm_on_stationary_rewards():
    tuner = SpecTuner(_config(seed=1))
    rates = {"eagle/6/3/12": 10.0, "eagle/4/3/6": 30.0, "off": 20.0}
    _play(tuner, rates, 200, batch=4, noise=random.Random(0))
    late = _play(tuner, rates, 400, batch=4, noise=random.Random(1))
    assert late["eagle/4/3/6"] / 400 > 0.9   # 1 - epsilon + epsilon / 3 in expectation
    medians = tuner.median_rewards()
    assert max(medians, key=medians.get) == "1:eagle/4/3/6"   # bucket from 1, its best arm


def test_re_adapts_when_the_rewards_shift():
    tuner = SpecTuner(_config(seed=2, window=50, max_age=150))
    _play(tuner, {"eagle/6/3/12": 10.0, "eagle/4/3/6": 30.0, "off": 20.0}, 300, 4,
          random.Random(0))
    shifted = {"eagle/6/3/12": 50.0, "eagle/4/3/6": 5.0, "off": 20.0}
    _play(tuner, shifted, 300, 4, random.Random(1))   # the windows refill with new rewards
    late = _play(tuner, shifted, 300, 4, random.Random(2))
    assert late.get("eagle/6/3/12", 0) / 300 > 0.85


def test_explores_every_arm_of_every_bucket_with_several_arms():
    tuner = SpecTuner(_config(seed=3))
    small = _play(tuner, {"eagle/6/3/12": 1.0, "eagle/4/3/6": 1.0, "off": 9.0}, 600, 2,
                  random.Random(0))
    large = _play(tuner, {"off": 9.0, "eagle/3/2/4": 1.0}, 600, 40, random.Random(1))
    assert set(small) == {"eagle/6/3/12", "eagle/4/3/6", "off"}
    assert set(large) == {"off", "eagle/3/2/4"}
    assert min(small.values()) >= 5 and min(large.values()) >= 5


def test_an_arm_in_two_buckets_is_judged_in_each_on_its_own_steps():
    """eagle/3/2/4 is the best arm at large batches and the worst at small ones: its large-batch
    rewards (more tokens a second at any arm) must not make it win the small bucket."""
    cfg = TunerConfig(buckets=(TunerBucket(min_batch=1, arms=_arms("eagle/6/3/12", "eagle/3/2/4")),
                               TunerBucket(min_batch=16, arms=_arms("off", "eagle/3/2/4"))),
                      epsilon=0.2, seed=5)
    tuner = SpecTuner(cfg)
    small = {"eagle/6/3/12": 30.0, "eagle/3/2/4": 20.0}
    large = {"off": 300.0, "eagle/3/2/4": 400.0}
    for _ in range(10):
        _play(tuner, large, 40, 64, random.Random(0))
        _play(tuner, small, 40, 2, random.Random(1))
    assert _play(tuner, small, 200, 2, random.Random(2))["eagle/6/3/12"] > 160
    assert _play(tuner, large, 200, 64, random.Random(3))["eagle/3/2/4"] > 160


def test_a_bucket_with_one_arm_always_plays_it_and_the_prior_leads_before_any_data():
    cfg = TunerConfig(buckets=(TunerBucket(min_batch=1, arms=(EAGLE,)),
                               TunerBucket(min_batch=32, arms=(OFF, EAGLE))), epsilon=0.0,
                      min_records=0)
    tuner = SpecTuner(cfg)
    assert all(tuner.select(5) == EAGLE for _ in range(20))
    assert tuner.select(64) == OFF   # no records yet: the elastic prior (first arm)
    tuner.record(EAGLE, 100, 64, 1.0)
    assert tuner.select(64) == EAGLE   # measured data overrules the prior


def test_state_round_trips_through_json_and_resumes_the_same_choices():
    tuner = SpecTuner(_config(seed=4))
    rates = {"eagle/6/3/12": 10.0, "eagle/4/3/6": 30.0, "off": 20.0, "eagle/3/2/4": 5.0}
    _play(tuner, rates, 120, 4, random.Random(0))
    _play(tuner, rates, 60, 20, random.Random(1))
    state = json.loads(json.dumps(tuner.state_dict()))
    resumed = SpecTuner(_config(seed=99))
    resumed.load_state_dict(state)
    assert resumed.median_rewards() == tuner.median_rewards()
    a = _play(tuner, rates, 100, 4, random.Random(5))
    b = _play(resumed, rates, 100, 4, random.Random(5))
    assert a == b and resumed.state_dict() == tuner.state_dict()


def test_default_arms_put_several_arms_in_every_bucket_and_off_first_past_the_threshold():
    cfg = TunerConfig.default(EAGLE, elastic_threshold=32, max_batch=200)
    assert [b.min_batch for b in cfg.buckets] == [1, 2, 4, 8, 16, 32, 64, 128]
    assert all(len(b.arms) >= 2 for b in cfg.buckets)
    assert cfg.buckets[0].arms[0] == EAGLE and cfg.buckets[-1].arms[0] == OFF
    assert max(a.tokens_to_verify for a in cfg.arms if a.enabled) == EAGLE.tokens_to_verify


def test_default_arms_of_a_merged_spec_compare_merged_and_eagle_trees_in_the_tail():
    merged = SpecConfig(method="eagle+suffix", depth=6, topk=3, tokens_to_verify=18)
    cfg = TunerConfig.default(merged, elastic_threshold=32, max_batch=64)
    tail = [arm_name(a) for a in cfg.buckets[0].arms]
    assert tail[0] == "eagle+suffix/6/3/18" and "eagle/6/3/12" in tail  # EAGLE's same 12 nodes
    assert all(a.method == "eagle" for b in cfg.buckets[3:] for a in b.arms if a.enabled)
    assert check_tuner(cfg, merged) is not None   # EAGLE-only arms are served by the merged one
    with pytest.raises(ValueError, match="must use one of"):
        check_tuner(cfg, EAGLE)


def test_bad_configs_are_refused_with_what_to_change():
    with pytest.raises(ValueError, match="start at batch 1"):
        TunerConfig(buckets=(TunerBucket(min_batch=4, arms=(EAGLE,)),))
    with pytest.raises(ValueError, match="epsilon"):
        _config(epsilon=1.5)
    with pytest.raises(ValueError, match="repeats"):
        TunerBucket(min_batch=1, arms=(EAGLE, EAGLE))
    with pytest.raises(ValueError, match=r"must use one of \['eagle'\]"):
        check_tuner(TunerConfig(buckets=(TunerBucket(min_batch=1, arms=_arms("suffix/4/1/4")),)),
                    EAGLE)
    with pytest.raises(ValueError, match=r"set spec\.method"):
        check_tuner(_config(), OFF)


def test_each_arm_plays_min_records_steps_in_listed_order_before_exploiting():
    tuner = SpecTuner(_config(epsilon=0.0, min_records=2))
    rates = {"eagle/6/3/12": 10.0, "eagle/4/3/6": 30.0, "off": 20.0}
    order = []
    for _ in range(9):
        arm = tuner.select(4)
        order.append(arm_name(arm))
        tuner.record(arm, int(rates[arm_name(arm)]), 4, 1.0)
    assert order == ["eagle/6/3/12"] * 2 + ["eagle/4/3/6"] * 2 + ["off"] * 2 + ["eagle/4/3/6"] * 3
