"""The held-out accept-length estimate: the chain rule against a plain loop, packed rows equal
to padded ones, depth 1 against 1 - TV(p, q) computed apart from the training-time test, and
the whole estimate against the accept length the engine measures drafting that chain."""

from __future__ import annotations

import random

import pytest
import torch

from fastdraft.drafter import build_drafter
from fastdraft.drafter.acceptance import chain_accept, expected_accept
from fastdraft.models import HiddenStates, load_model

LENGTHS = (7, 12, 4, 9)


@pytest.fixture(scope="module")
def policy(tiny_checkpoint):
    return load_model(tiny_checkpoint[0]).eval()


def test_the_chain_rule_equals_a_plain_loop_over_chains():
    g = torch.Generator().manual_seed(0)
    survive = [torch.rand(3, 10, generator=g) for _ in range(4)]
    scored = [torch.rand(3, 10, generator=g) > 0.2 for _ in range(4)]
    total, chains = 0.0, 0
    for b in range(3):
        for t in range(10):
            if not scored[0][b, t]:
                continue
            chains += 1
            alive, expected = 1.0, 1.0
            for a, ok in zip(survive, scored):
                if not ok[b, t]:
                    break
                alive *= float(a[b, t])
                expected += alive
            total += expected
    got = chain_accept(survive, scored)
    assert got.chains == chains and got.total == pytest.approx(total, rel=1e-6)


def _rows(policy, seqs, aux, packed: bool):
    """The sequences padded into rows of their own, or packed into one row."""
    if packed:
        ids = torch.tensor([[t for s in seqs for t in s]])
        segments = torch.tensor([[i for i, s in enumerate(seqs) for _ in s]])
        positions = torch.tensor([[p for s in seqs for p in range(len(s))]])
        parts = []
        with torch.no_grad():   # each sequence run on its own, as the engine captured them
            for i in range(len(seqs)):
                cols = segments[0] == i
                parts.append(policy(ids[:, cols], positions[:, cols], aux_layers=aux)[1])
        hidden = HiddenStates(torch.cat([p.final for p in parts], 1),
                              tuple(torch.cat([p.aux[k] for p in parts], 1)
                                    for k in range(len(aux))))
        return ids, hidden, torch.ones_like(ids, dtype=torch.bool), segments, positions
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    valid = torch.zeros(len(seqs), width, dtype=torch.bool)
    for row, s in enumerate(seqs):
        ids[row, : len(s)], valid[row, : len(s)] = torch.tensor(s), True
    positions = torch.arange(width).expand(len(seqs), -1)
    with torch.no_grad():
        hidden = policy(ids, positions, aux_layers=aux)[1]
    return ids, hidden, valid, None, None


@pytest.mark.parametrize("kind,num_steps", [("eagle1", 2), ("eagle3", 3)])
def test_packed_rows_give_the_estimate_of_padded_rows(policy, kind, num_steps):
    torch.manual_seed(0)
    drafter = build_drafter(kind, policy.config, 128).attach(policy)
    rng = random.Random(0)
    seqs = [[rng.randrange(3, 64) for _ in range(n)] for n in LENGTHS]
    estimates = []
    for packed in (False, True):
        ids, hidden, valid, segments, positions = _rows(policy, seqs, drafter.aux_layers, packed)
        estimates.append(expected_accept(drafter, ids, hidden, valid, policy.lm_head, num_steps,
                                         segments, positions))
    padded, packed = estimates
    assert padded.chains == packed.chains == sum(n - 1 for n in LENGTHS)
    assert packed.mean == pytest.approx(padded.mean, rel=1e-5)
    assert 1.0 <= padded.mean <= 1.0 + num_steps


def test_depth_one_is_one_plus_the_overlap_of_the_drafters_and_the_policys_laws(policy):
    torch.manual_seed(1)
    drafter = build_drafter("eagle1", policy.config, 128).attach(policy)
    ids = torch.tensor([[5, 9, 17, 3, 40, 22, 8]])
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        logits, hidden = policy(ids, positions)
        # the drafter at pair t reads (features of token t, token t+1) and drafts token t+2
        feats = drafter.target_features(hidden)[:, :-1]
        _, draft_logits = drafter.step(feats, ids[:, 1:], positions[:, 1:], None, None)
    p = logits.float().softmax(-1)   # the policy's law of token t+2 sits at index t+1
    q = draft_logits.float().softmax(-1)
    survive = [float(torch.minimum(p[0, t + 1], q[0, t]).sum()) for t in range(ids.shape[1] - 1)]
    got = expected_accept(drafter, ids, hidden, torch.ones_like(ids, dtype=torch.bool),
                          policy.lm_head, 1)
    assert got.chains == ids.shape[1] - 1
    assert got.mean == pytest.approx(1 + sum(survive) / len(survive), rel=1e-5)


def test_the_estimate_is_the_accept_length_the_engine_measures_on_that_chain(char_policy,
                                                                              char_drafter):
    """Drafts sampled from the drafter, verified at temperature 1 by the engine (a chain:
    topk 1, depth 3): its accept length over ~2000 drafted tokens against the estimate on the
    same rollouts. Both a random tiny policy and drafter: q and p are far from equal."""
    from fastdraft import RolloutEngine, SamplingParams, SpecConfig
    from fastdraft.drafter.checkpoint import load_drafter
    engine = RolloutEngine(char_policy, max_batch_size=32, max_seq_len=96, drafter=char_drafter,
                           spec=SpecConfig(method="eagle", depth=3, topk=1, tokens_to_verify=4))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 30) for _ in range(rng.randrange(3, 9))] for _ in range(32)]
    done = engine.generate(prompts, SamplingParams(temperature=1.0, seed=0, max_new_tokens=64))
    measured = engine.last_stats.as_metrics()["rollout/accept_length"]
    seqs = [p + list(c.token_ids) for p, c in zip(prompts, done)]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    valid = torch.zeros(len(seqs), width, dtype=torch.bool)
    for row, (p, s) in enumerate(zip(prompts, seqs)):
        ids[row, : len(s)], valid[row, len(p) - 1: len(s)] = torch.tensor(s), True
    policy = load_model(char_policy).eval()
    drafter = load_drafter(char_drafter, policy, 512)
    with torch.no_grad():
        hidden = policy(ids, torch.arange(width).expand(len(seqs), -1))[1]
    estimate = expected_accept(drafter, ids, hidden, valid, policy.lm_head, 3)
    assert estimate.chains > 1000 and 1.3 < measured < 3.7
    assert estimate.mean == pytest.approx(measured, rel=0.04), (estimate.mean, measured)
