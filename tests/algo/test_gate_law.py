"""The lossless gate end to end on a speculative rollout: EAGLE drafts verified by rejection
sampling, the actor's TokenStats from a plain forward over prompt + answer. A correct verifier
passes; a verifier biased to accept every draft passes every per-token check (the engine reports
the log p of the token it emitted, which the actor recomputes exactly) and is caught by the law
statistic."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fastdraft import RolloutEngine, SamplingParams
from fastdraft.algo.gate import GateTolerance, LosslessGateError, check_gate
from fastdraft.algo.sequences import build_batch
from fastdraft.algo.token_stats import token_stats
from fastdraft.config.engine import SpecConfig
from fastdraft.engine import draws
from fastdraft.models import load_model

PROMPTS = [[3 + i % 7, 5, 2 + i % 11] for i in range(64)]
SPEC = SpecConfig(method="eagle", depth=3, topk=3, tokens_to_verify=6)
FP32 = GateTolerance.for_dtypes("float32", "float32")


def _rollout_and_actor_stats(path, drafter, params: SamplingParams):
    engine = RolloutEngine(path, max_batch_size=64, max_seq_len=64, spec=SPEC, drafter=drafter)
    outs = engine.generate(PROMPTS, params, use_tqdm=False)
    assert engine.last_stats.num_accepted > 300            # drafts are on the path
    batch = build_batch(PROMPTS, [o.token_ids for o in outs], [o.logprobs for o in outs],
                        [0.0] * len(outs))
    policy = load_model(path)
    with torch.no_grad():   # the actor's plain forward, the one its gradient would come from
        positions = torch.arange(batch.input_ids.shape[1]).expand_as(batch.input_ids)
        logits, _ = policy(batch.input_ids, positions)
    stats = token_stats(logits[:, :-1], batch.input_ids[:, 1:], params.temperature,
                        params.top_p, params.top_k, mask=batch.mask)
    return stats, batch


def _accept_every_draft(monkeypatch):
    """A broken verifier: every node's uniform is 0, so u * q(x) < p(x) accepts any draft the
    policy gives mass to (instead of with probability min(1, p/q))."""
    real = draws.accept_sampled

    def biased(drafts, logits, st, node_uniforms, *args, **kwargs):
        return real(drafts, logits, st, torch.zeros_like(node_uniforms), *args, **kwargs)
    monkeypatch.setattr(draws, "accept_sampled", biased)


@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 1.0, -1), (0.7, 0.9, 20)])
def test_a_correct_speculative_rollout_passes_the_gate(tiny_checkpoint, random_drafter,
                                                       temperature, top_p, top_k):
    """Filtered sampling too: the actor's TokenStats filter as the engine's sampler does (were
    the entropies of the unfiltered law, z would be far below -6)."""
    path, _ = tiny_checkpoint
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=7,
                            max_new_tokens=32)
    stats, batch = _rollout_and_actor_stats(path, random_drafter, params)
    metrics = check_gate(stats, batch.old_logprobs, batch.mask, FP32)
    assert metrics["rollout/logprob_diff_max"] < 1e-4
    assert metrics["rollout/law_tokens"] > 1000 and metrics["rollout/law_outside_filter"] == 0
    assert abs(metrics["rollout/law_z"]) < 4


def test_a_verifier_that_accepts_every_draft_is_caught_by_the_law(tiny_checkpoint,
                                                                  random_drafter, monkeypatch):
    path, _ = tiny_checkpoint
    _accept_every_draft(monkeypatch)
    params = SamplingParams(temperature=1.0, seed=7, max_new_tokens=32)
    stats, batch = _rollout_and_actor_stats(path, random_drafter, params)
    per_token = check_gate(stats, batch.old_logprobs, batch.mask, replace(FP32, law_z=None))
    assert per_token["rollout/logprob_diff_max"] < 1e-4   # every logprob agrees...
    with pytest.raises(LosslessGateError, match=r"not drawn from the policy's law: z = \d+"):
        check_gate(stats, batch.old_logprobs, batch.mask, FP32)   # ...the law does not
