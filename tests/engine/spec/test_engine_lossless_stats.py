"""End-to-end losslessness of the speculative ENGINE under sampling: continuations generated with
EAGLE draft trees (sampled, pruned) have the policy's own distribution (chi-square on a tiny
vocabulary), and a deliberately broken acceptance rule is detected by the same test."""

from __future__ import annotations

import pytest
import torch

from fastdraft import RolloutEngine, SamplingParams
from fastdraft.config.engine import SpecConfig
from fastdraft.drafter import load_drafter
from fastdraft.engine.envelope import Envelope
from fastdraft.engine.spec import accept as accept_mod
from fastdraft.engine.spec.eagle import EagleProposer
from fastdraft.engine.spec.probs import processed_probs
from fastdraft.models import load_model
from tests.engine.spec.stat_utils import chi_square_pvalue, counts_of, exact_sequence_probs

VOCAB, LENGTH, NUM_SAMPLES = 8, 3, 10_000
# Request i draws from seed + i, so nearby seeds share most of their streams (seeds 11..14 are
# one sample, shifted). 100_000 is unrelated to the engine's other seeded tests.
SEED = 100_000
PROMPT = [3, 5, 2]


def _expected(hf, params: SamplingParams, length: int = LENGTH) -> dict:
    """The exact law of the first `length` tokens after PROMPT."""
    def next_probs(prefix):
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + list(prefix)])).logits[0, -1]
        return processed_probs(logits.double(), params).tolist()
    return exact_sequence_probs(next_probs, length, VOCAB)


def _sample(path, params: SamplingParams, restricted: bool = False, method: str = "eagle",
            **kv: int) -> dict:
    """method "eagle+suffix": EAGLE's 3 nodes + 3 suffix nodes grafted in (chosen candidates
    next to sampled children under one parent); the suffix drafter's sources are the
    rollouts of PROMPT that finished earlier in the same call."""
    spec = SpecConfig(method=method, depth=3, topk=3, tokens_to_verify=6)
    proposer = None
    if restricted:  # a draft vocabulary of 6 of the 8 tokens, children drawn from q's top 3
        policy = load_model(path)
        drafter = load_drafter(path / "drafter", policy, 64)
        proposer = EagleProposer(drafter=drafter, num_slots=512, sample_top_m=3,
                                 envelope=Envelope.for_spec(16, spec),
                                 draft_token_ids=torch.tensor([0, 2, 3, 5, 6, 7]))
        engine = RolloutEngine.from_model(policy, max_batch_size=512, max_seq_len=16,
                                          spec=spec, proposer=proposer)
    else:
        engine = RolloutEngine(path, max_batch_size=512, max_seq_len=16, spec=spec,
                               drafter=path / "drafter", **kv)
    outs = engine.generate([PROMPT] * NUM_SAMPLES, params)
    assert engine.last_stats.num_accepted > 0.2 * NUM_SAMPLES  # the draft path is exercised
    if kv:   # a paged pool too small for the batch: requests were preempted and recomputed
        assert engine.last_trace.preemptions > 0.05 * NUM_SAMPLES
    if method == "eagle+suffix":  # and so are the grafted candidates
        assert engine.last_stats.accepted_by_source.get("suffix", 0) > 0.1 * NUM_SAMPLES
    return counts_of([o.token_ids for o in outs], LENGTH)


@pytest.mark.parametrize("temperature, top_p, restricted, method", [
    (1.0, 1.0, False, "eagle"), (0.6, 1.0, False, "eagle"), (1.0, 0.8, False, "eagle"),
    (1.0, 1.0, True, "eagle"), (1.0, 1.0, False, "eagle+suffix"),
    (0.7, 0.9, False, "eagle+suffix")])
def test_engine_sampling_is_the_policy_distribution(tiny_vocab, temperature, top_p,
                                                    restricted, method):
    """restricted: drafts over a draft vocabulary and q's top m only (any q is lossless when
    verification divides by the q drawn from)."""
    path, hf = tiny_vocab
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=SEED,
                            max_new_tokens=LENGTH, ignore_eos=True)
    pvalue = chi_square_pvalue(_sample(path, params, restricted, method),
                               _expected(hf, params))
    assert pvalue > 0.01


def test_engine_sampling_with_forced_preemptions_is_the_policy_distribution(tiny_vocab):
    path, hf = tiny_vocab
    params = SamplingParams(temperature=1.0, seed=SEED, max_new_tokens=LENGTH, ignore_eos=True)
    counts = _sample(path, params, kv_block_size=2, kv_blocks=120)
    assert chi_square_pvalue(counts, _expected(hf, params)) > 0.01


def test_engine_test_detects_a_broken_acceptance_rule(tiny_vocab, monkeypatch):
    """Forgetting to remove q's mass from the residual after a rejection (residual = p) must be
    caught by the same test at the same sample size."""
    path, hf = tiny_vocab
    real = accept_mod._reject_rows

    def broken(pq, x, sampled, keep_p):
        out = real(pq, x, sampled, keep_p).clone()
        out[:, 0] = pq[:, 0]  # p is not updated after a rejection
        return out
    monkeypatch.setattr(accept_mod, "_reject_rows", broken)
    params = SamplingParams(temperature=1.0, seed=SEED, max_new_tokens=LENGTH, ignore_eos=True)
    assert chi_square_pvalue(_sample(path, params), _expected(hf, params)) < 1e-4


def test_engine_test_detects_grafted_candidates_verified_as_samples(tiny_vocab, monkeypatch):
    """Merged trees: verifying the grafted suffix candidates by their parent's kind (as draws
    from q, what a per-parent flag does) instead of as point masses must be caught."""
    from fastdraft.engine.spec import merged
    path, hf = tiny_vocab
    real = merged.graft_into

    def flagged_as_sampled(buffers, batch, base_width, width, *rest):
        real(buffers, batch, base_width, width, *rest)
        buffers.is_sampled[:batch, :width] = True
    monkeypatch.setattr(merged, "graft_into", flagged_as_sampled)
    params = SamplingParams(temperature=1.0, seed=SEED, max_new_tokens=LENGTH, ignore_eos=True)
    assert chi_square_pvalue(_sample(path, params, method="eagle+suffix"),
                             _expected(hf, params)) < 1e-4
