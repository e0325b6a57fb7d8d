"""The engine with length-aware budgets: rows predicted short decode plainly beside the trees of
the rows predicted long, in one forward. Greedy output equals plain greedy token for token and
sampled output has the policy's distribution, with the split drawn at random every step (every
row, every kind of step); with the real predictor, requests of prompts whose earlier answers
were short stop speculating."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from fastdraft import RolloutEngine, SamplingParams
from fastdraft.config.engine import BudgetConfig, SpecConfig
from fastdraft.engine.request import prompt_key
from fastdraft.engine.spec.budget import LengthBudget
from tests.engine.spec.stat_utils import chi_square_test
from tests.engine.spec.test_adaptive_engine import LENGTH, _last_two, _prompts, _switching
from tests.engine.spec.test_engine_lossless_stats import NUM_SAMPLES, PROMPT, SEED, _expected

SPEC = SpecConfig(method="eagle", depth=4, topk=3, tokens_to_verify=8)


@pytest.fixture
def random_split(monkeypatch):
    """Each step, every row speculates with probability 1/2 (the rest decode plainly);
    records how many rows of each kind the steps had."""
    rng = random.Random(11)
    kinds: Counter = Counter()

    def speculating(self, remaining):
        chosen = [rng.random() < 0.5 for _ in remaining]
        kinds["split" if 0 < sum(chosen) < len(chosen) else "whole"] += 1
        return chosen
    monkeypatch.setattr(LengthBudget, "speculating", speculating)
    return kinds


@pytest.mark.parametrize("method", ["eagle", "eagle+suffix", "suffix"])
def test_greedy_with_random_splits_equals_plain_greedy(tiny_checkpoint, random_drafter,
                                                       random_split, method):
    path, _ = tiny_checkpoint
    prompts = _prompts(9, seed=3) * 2
    params = SamplingParams(greedy=True, max_new_tokens=24)
    plain = RolloutEngine(path, max_batch_size=6, max_seq_len=96).generate(prompts, params)
    engine = RolloutEngine(path, max_batch_size=6, max_seq_len=96,
                           spec=SpecConfig(method=method, depth=4, topk=3, tokens_to_verify=8),
                           drafter=None if method == "suffix" else random_drafter,
                           budget=BudgetConfig())
    outs = engine.generate(prompts, params)
    assert [c.token_ids for c in outs] == [c.token_ids for c in plain]
    assert random_split["split"] > 10
    assert engine.last_stats.num_accepted > 0


def test_greedy_with_random_splits_and_a_tuner_equals_plain_greedy(tiny_checkpoint,
                                                                   random_drafter,
                                                                   random_split):
    path, _ = tiny_checkpoint
    prompts = _prompts(9, seed=4) * 2
    params = SamplingParams(greedy=True, max_new_tokens=24)
    plain = RolloutEngine(path, max_batch_size=6, max_seq_len=96).generate(prompts, params)
    engine = RolloutEngine(path, max_batch_size=6, max_seq_len=96, spec=SPEC,
                           drafter=random_drafter, budget=BudgetConfig(),
                           tuner=_switching("eagle/4/3/8", "off", "eagle/2/2/3"))
    outs = engine.generate(prompts, params)
    assert [c.token_ids for c in outs] == [c.token_ids for c in plain]
    assert random_split["split"] > 10 and Counter(engine.last_trace.arms)["off"] > 3


def test_sampling_with_random_splits_is_the_policy_distribution(tiny_vocab, random_split):
    """Rows speculate or decode plainly at random every step (slots swapped to put the
    speculating rows first): tokens 3 and 4, decided after two or more such steps, have the
    policy's joint law."""
    path, hf = tiny_vocab
    params = SamplingParams(temperature=1.0, seed=SEED + 50_000, max_new_tokens=LENGTH,
                            ignore_eos=True)
    engine = RolloutEngine(path, max_batch_size=512, max_seq_len=16,
                           spec=SpecConfig(method="eagle", depth=2, topk=3, tokens_to_verify=6),
                           drafter=path / "drafter", budget=BudgetConfig())
    outs = engine.generate([PROMPT] * NUM_SAMPLES, params)
    assert random_split["split"] >= 2
    assert engine.last_stats.num_accepted > 0.1 * NUM_SAMPLES
    observed = Counter(tuple(o.token_ids[2:LENGTH]) for o in outs)
    check = chi_square_test(observed, _last_two(_expected(hf, params, LENGTH)))
    assert check.pvalue > 0.01, check.describe()


def test_with_history_short_prompts_decode_plainly_and_output_is_unchanged(tiny_checkpoint,
                                                                          random_drafter):
    """A first rollout is the history: in the second, requests of prompts whose earlier answers
    were short stop drafting while the long ones still speculate (split steps), and the output
    is plain greedy's; state saved mid-run predicts the same."""
    path, _ = tiny_checkpoint
    prompts = _prompts(12, seed=8)
    lengths = [4 + 40 * (i % 3 == 0) for i in range(len(prompts))]   # a long-tailed batch
    params = [SamplingParams(greedy=True, max_new_tokens=n, ignore_eos=True) for n in lengths]
    plain = RolloutEngine(path, max_batch_size=12, max_seq_len=96).generate(prompts, params)
    engine = RolloutEngine(path, max_batch_size=12, max_seq_len=96, spec=SPEC,
                           drafter=random_drafter, budget=BudgetConfig())
    engine.generate(prompts, params)
    assert engine.last_trace.drafting_row_fraction == pytest.approx(1.0)   # no history yet
    engine.advance_step()
    outs = engine.generate(prompts, params)
    assert [c.token_ids for c in outs] == [c.token_ids for c in plain]
    trace = engine.last_trace
    split = [(n, a) for n, a, arm in zip(trace.drafting, trace.active, trace.arms)
             if arm != "prefill" and 0 < n < a]
    assert len(split) >= 2 and all(n == 4 for n, _ in split)   # the four long requests
    assert trace.drafting_row_fraction < 1
    restored = LengthBudget(BudgetConfig())
    restored.load_state_dict(engine.budget.state_dict())
    key = prompt_key(prompts[0])
    assert restored.predict_remaining(key, 5) == engine.budget.predict_remaining(key, 5) == 39


def test_split_steps_keep_the_drafter_cache_in_step(tiny_checkpoint, random_drafter,
                                                    random_split):
    """Rows that decode plainly in a split step commit their token to the drafter (at their own
    slots, after swaps): at the end each request's drafter cells equal a prefill's over its
    whole sequence."""
    path, _ = tiny_checkpoint
    prompts = _prompts(4, seed=6)
    engine = RolloutEngine(path, max_batch_size=4, max_seq_len=96, spec=SPEC,
                           drafter=random_drafter, budget=BudgetConfig())
    outs = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=30,
                                                   ignore_eos=True))
    assert random_split["split"] >= 3
    for prompt, out in zip(prompts, outs):
        sequence = prompt + out.token_ids
        fresh = RolloutEngine(path, max_batch_size=1, max_seq_len=96, spec=SPEC,
                              drafter=random_drafter)
        fresh.generate([sequence[:-1]], SamplingParams(greedy=True, max_new_tokens=1))
        cells = slice(1, len(sequence))   # cell t + 1 holds (hidden t, token t + 1)
        theirs = fresh.proposer.k[0][0, :, cells]
        assert any(torch.allclose(engine.proposer.k[0][slot, :, cells], theirs, rtol=1e-4,
                                  atol=1e-5) for slot in range(len(prompts)))


@pytest.mark.parametrize("kind", ["greedy", "mixed"])
def test_split_steps_read_nothing_back_inside_a_step(tiny_checkpoint, random_drafter,
                                                     random_split, monkeypatch, kind):
    """The path captured graphs run: a split step (slot swaps, a packed verify, two commits)
    syncs with the host nowhere, and reads its results back once."""
    from tests.engine.test_static_steps import _params, counting_syncs
    from tests.engine.test_static_steps import _prompts as mixed_prompts
    path, _ = tiny_checkpoint
    engine = RolloutEngine(path, max_batch_size=4, max_seq_len=64,
                           spec=SpecConfig(method="eagle", depth=3, topk=2, tokens_to_verify=6),
                           drafter=random_drafter, budget=BudgetConfig())
    engine.eager_shortcuts = False
    steps = []
    for name in ("_decode", "_speculate"):
        real = getattr(engine, name)
        monkeypatch.setattr(engine, name,
                            lambda *args, real=real: steps.append(1) or real(*args))
    prompts = mixed_prompts()
    with counting_syncs(engine, monkeypatch) as (counter, transfers):
        engine.generate(prompts, _params(kind, len(prompts)))
    assert counter.syncs == []
    assert len(transfers) == len(steps) > 0 and random_split["split"] > 3


def test_split_steps_padded_to_coarse_buckets_change_no_output(tiny_checkpoint, random_drafter,
                                                               random_split):
    """Graph buckets (batch 2 / 8): the drafting rows grow to a bucket, the plain rows are
    padded with free slots; still plain greedy token for token."""
    from fastdraft.engine.buckets import BucketPlan
    from fastdraft.engine.envelope import Envelope
    path, _ = tiny_checkpoint
    prompts = _prompts(11, seed=9)
    params = SamplingParams(greedy=True, max_new_tokens=20)
    plain = RolloutEngine(path, max_batch_size=8, max_seq_len=64).generate(prompts, params)
    cache_len = Envelope.for_spec(64, SPEC).cache_len
    engine = RolloutEngine(path, max_batch_size=8, max_seq_len=64, spec=SPEC,
                           drafter=random_drafter, budget=BudgetConfig(),
                           buckets=BucketPlan(batch_sizes=(2, 8),
                                              context_lens=(16, 48, cache_len)))
    outs = engine.generate(prompts, params)
    assert [c.token_ids for c in outs] == [c.token_ids for c in plain]
    trace = engine.last_trace
    assert any(0 < n < a for n, a, arm in zip(trace.drafting, trace.active, trace.arms)
               if arm != "prefill")


def test_after_a_fallback_to_plain_decoding_budgets_move_nothing(tiny_checkpoint,
                                                                random_drafter, random_split):
    path, _ = tiny_checkpoint
    engine = RolloutEngine(path, max_batch_size=6, max_seq_len=96, spec=SPEC,
                           drafter=random_drafter, budget=BudgetConfig())
    engine.fall_back_to_plain("a test")
    prompts = _prompts(6, seed=2)
    params = SamplingParams(greedy=True, max_new_tokens=8)
    outs = engine.generate(prompts, params)
    plain = RolloutEngine(path, max_batch_size=6, max_seq_len=96).generate(prompts, params)
    assert [c.token_ids for c in outs] == [c.token_ids for c in plain]
    assert random_split["split"] == random_split["whole"] == 0   # never consulted
    assert set(engine.last_trace.arms) <= {"prefill", "off"}
