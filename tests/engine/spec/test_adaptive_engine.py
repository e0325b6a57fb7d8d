"""The engine with a tuner switching the speculation config every step: greedy output equals plain
greedy, sampled output has the policy's distribution for tokens decided after several switched
steps, and plain steps keep the EAGLE drafter's cache in step (no re-prefill, no lost
acceptance when speculation comes back)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from fastdraft import RolloutEngine, SamplingParams
from fastdraft.config.engine import SpecConfig, TunerBucket, TunerConfig, parse_arm
from tests.engine.spec.stat_utils import chi_square_test
from tests.engine.spec.test_engine_lossless_stats import (
    NUM_SAMPLES,
    PROMPT,
    SEED,
    _expected,
)

LARGEST = SpecConfig(method="eagle", depth=4, topk=3, tokens_to_verify=8)


def _switching(*names: str, method: str = "eagle") -> TunerConfig:
    """epsilon = 1: a uniformly random arm every step, in every bucket."""
    arms = tuple(parse_arm(n.replace("eagle", method)) for n in names)
    return TunerConfig(buckets=(TunerBucket(min_batch=1, arms=arms),
                                TunerBucket(min_batch=3, arms=arms[::-1])), epsilon=1.0, seed=7)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 64) for _ in range(rng.randrange(1, 25))] for _ in range(n)]


@pytest.mark.parametrize("method", ["eagle", "suffix"])
def test_greedy_with_an_arm_switch_every_step_equals_plain_greedy(tiny_checkpoint,
                                                                  random_drafter, method):
    path, _ = tiny_checkpoint
    prompts = _prompts(9, seed=3) * 2   # repeated prompts: the suffix drafter has sources
    params = SamplingParams(greedy=True, max_new_tokens=24)
    plain = RolloutEngine(path, max_batch_size=4, max_seq_len=96).generate(prompts, params)
    tuner = _switching("eagle/4/3/8", "off", "eagle/1/2/2", "eagle/2/1/3", method=method)
    engine = RolloutEngine(path, max_batch_size=4, max_seq_len=96,
                           spec=SpecConfig(method=method, depth=4, topk=3, tokens_to_verify=8),
                           drafter=random_drafter if method == "eagle" else None, tuner=tuner)
    outs = engine.generate(prompts, params)
    assert [c.token_ids for c in outs] == [c.token_ids for c in plain]
    arms = Counter(engine.last_trace.arms)
    assert arms["off"] > 5 and sum(n for a, n in arms.items() if a.startswith(method)) > 10
    assert 0 < engine.last_trace.sd_fraction < 1
    assert {k.split(":")[1] for k in engine.tuner.median_rewards()} == {
        a for a in arms if a != "prefill"}


def test_plain_steps_keep_the_drafter_cache_in_step(tiny_checkpoint, random_drafter):
    """After a rollout whose steps switch between off and EAGLE, the drafter's KV cells of the
    request equal those a drafter prefill over the whole sequence writes: switching back on
    drafts exactly as if speculation had never been off."""
    path, _ = tiny_checkpoint
    prompt = _prompts(1, seed=5)[0]
    tuner = _switching("off", "eagle/2/2/3")
    engine = RolloutEngine(path, max_batch_size=1, max_seq_len=96, spec=LARGEST,
                           drafter=random_drafter, tuner=tuner)
    out = engine.generate([prompt], SamplingParams(greedy=True, max_new_tokens=30,
                                                   ignore_eos=True))[0]
    assert Counter(engine.last_trace.arms)["off"] >= 3
    sequence = prompt + out.token_ids
    fresh = RolloutEngine(path, max_batch_size=1, max_seq_len=96, spec=LARGEST,
                          drafter=random_drafter)
    fresh.generate([sequence[:-1]], SamplingParams(greedy=True, max_new_tokens=1))
    cells = slice(1, len(sequence))   # cell t + 1 holds (hidden t, token t + 1)
    for ours, theirs in ((engine.proposer.k[0], fresh.proposer.k[0]),
                         (engine.proposer.v[0], fresh.proposer.v[0])):
        torch.testing.assert_close(ours[0, :, cells], theirs[0, :, cells], rtol=1e-4, atol=1e-5)


def test_without_feeding_the_drafter_the_cache_check_fails(tiny_checkpoint, random_drafter,
                                                          monkeypatch):
    """The check above is not vacuous: skip the drafter's commit after plain steps and the
    cells of those tokens differ."""
    from fastdraft.engine.spec.eagle import EagleProposer
    real = EagleProposer.commit

    def commit_only_after_verify(self, io, batch, ctx_len, width=None):
        if width != 1:
            real(self, io, batch, ctx_len, width)
    monkeypatch.setattr(EagleProposer, "commit", commit_only_after_verify)
    with pytest.raises(AssertionError):
        test_plain_steps_keep_the_drafter_cache_in_step(tiny_checkpoint, random_drafter)


LENGTH = 4   # tokens 3 and 4 come after a prefill and at least two switched steps


def _last_two(outcomes: dict) -> dict:
    marginal: dict = Counter()
    for seq, p in outcomes.items():
        marginal[seq[-2:]] += p
    return marginal


def test_sampling_with_switched_steps_is_the_policy_distribution(tiny_vocab):
    """Arms of depth <= 1 and off, one at random per step: the 3rd and 4th tokens are decided
    after two or more steps of different kinds; their joint law is the policy's."""
    path, hf = tiny_vocab
    params = SamplingParams(temperature=1.0, seed=SEED + 7, max_new_tokens=LENGTH,
                            ignore_eos=True)
    tuner = _switching("eagle/1/3/3", "off", "eagle/1/2/2")
    engine = RolloutEngine(path, max_batch_size=512, max_seq_len=16,
                           spec=SpecConfig(method="eagle", depth=2, topk=3, tokens_to_verify=6),
                           drafter=path / "drafter", tuner=tuner)
    outs = engine.generate([PROMPT] * NUM_SAMPLES, params)
    assert Counter(engine.last_trace.arms)["off"] > 2
    assert engine.last_stats.num_accepted > 0.1 * NUM_SAMPLES
    observed = Counter(tuple(o.token_ids[2:LENGTH]) for o in outs)
    check = chi_square_test(observed, _last_two(_expected(hf, params, LENGTH)))
    assert check.pvalue > 0.01, check.describe()


MERGED = SpecConfig(method="eagle+suffix", depth=4, topk=3, tokens_to_verify=8)


def test_greedy_with_merged_trees_and_switched_steps_equals_plain_greedy(tiny_checkpoint,
                                                                         random_drafter):
    """EAGLE + suffix trees (suffix candidates grafted into EAGLE's), EAGLE-only trees and
    plain steps, one at random per step: still plain greedy token for token, and the grafted
    suffix candidates are accepted (the second copy of each prompt copies the first)."""
    path, _ = tiny_checkpoint
    prompts = _prompts(9, seed=3) * 2
    params = SamplingParams(greedy=True, max_new_tokens=24)
    plain = RolloutEngine(path, max_batch_size=4, max_seq_len=96).generate(prompts, params)
    tuner = _switching("eagle+suffix/4/3/8", "off", "eagle/2/2/3", "eagle+suffix/3/2/6")
    engine = RolloutEngine(path, max_batch_size=4, max_seq_len=96, spec=MERGED,
                           drafter=random_drafter, tuner=tuner)
    outs = engine.generate(prompts, params)
    assert [c.token_ids for c in outs] == [c.token_ids for c in plain]
    assert engine.last_stats.accepted_by_source.get("suffix", 0) > 20
    assert Counter(engine.last_trace.arms)["eagle+suffix/4/3/8"] > 3


def test_sampling_with_merged_trees_and_switched_steps_is_the_policy_distribution(tiny_vocab):
    """Merged trees put chosen suffix candidates next to sampled EAGLE children under one
    parent; with off / EAGLE / merged steps switched at random, tokens 3 and 4 (decided after
    two or more steps) have the policy's joint law."""
    path, hf = tiny_vocab
    params = SamplingParams(temperature=1.0, seed=SEED + 11, max_new_tokens=LENGTH,
                            ignore_eos=True)
    tuner = _switching("eagle+suffix/2/3/6", "off", "eagle/1/2/2")
    engine = RolloutEngine(path, max_batch_size=512, max_seq_len=16,
                           spec=SpecConfig(method="eagle+suffix", depth=2, topk=3,
                                           tokens_to_verify=6),
                           drafter=path / "drafter", tuner=tuner)
    outs = engine.generate([PROMPT] * NUM_SAMPLES, params)
    assert engine.last_stats.accepted_by_source.get("suffix", 0) > 0.02 * NUM_SAMPLES
    observed = Counter(tuple(o.token_ids[2:LENGTH]) for o in outs)
    check = chi_square_test(observed, _last_two(_expected(hf, params, LENGTH)))
    assert check.pvalue > 0.01, check.describe()


def test_a_tuner_widens_the_engine_to_its_largest_arm(tiny_checkpoint, random_drafter):
    path, _ = tiny_checkpoint
    tuner = TunerConfig(buckets=(TunerBucket(min_batch=1, arms=(
        parse_arm("eagle/7/2/20"), parse_arm("off"))),))
    engine = RolloutEngine(path, max_batch_size=2, max_seq_len=64, spec=LARGEST,
                           drafter=random_drafter, tuner=tuner)
    assert (engine.envelope.max_depth, engine.envelope.max_tree_nodes) == (7, 20)
    with pytest.raises(ValueError, match=r"must use one of \['eagle'\]"):
        RolloutEngine(path, max_batch_size=2, max_seq_len=64, spec=LARGEST,
                      drafter=random_drafter, tuner=_switching("eagle/2/2/2", method="suffix"))
