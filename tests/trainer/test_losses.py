"""Online drafter losses: packed rows give exactly the loss and gradients of the same sequences
padded into rows of their own, and reward-weighted KD weights samples by their rewards."""

from __future__ import annotations

import random

import pytest
import torch

from fastdraft.drafter import build_drafter
from fastdraft.models import HiddenStates, load_model
from fastdraft.trainer.losses import (
    DraftBatch,
    compute_drafter_loss,
    drafter_loss_names,
    reward_weights,
)

LENGTHS = (7, 12, 4, 9)


@pytest.fixture(scope="module")
def policy(tiny_checkpoint):
    return load_model(tiny_checkpoint[0]).eval()


def _sequences() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 64) for _ in range(n)] for n in LENGTHS]


def _hidden(policy, ids, positions, aux, segments=None):
    """The policy's hidden states; packed rows are run one sequence at a time, as the engine
    captured them."""
    if segments is None:
        with torch.no_grad():
            return policy(ids, positions, aux_layers=aux)[1]
    parts = []
    with torch.no_grad():
        for s in segments[0].unique_consecutive():
            cols = segments[0] == s
            parts.append(policy(ids[:, cols], positions[:, cols], aux_layers=aux)[1])
    return HiddenStates(torch.cat([p.final for p in parts], 1),
                        tuple(torch.cat([p.aux[i] for p in parts], 1) for i in range(len(aux))))


def _padded(policy, seqs, aux, rewards=None) -> DraftBatch:
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    valid = torch.zeros(len(seqs), width, dtype=torch.bool)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.tensor(s)
        valid[row, : len(s)] = True
    positions = torch.arange(width).expand(len(seqs), -1)
    return DraftBatch(ids, _hidden(policy, ids, positions, aux), valid, rewards)


def _packed(policy, seqs, aux, rewards=None) -> DraftBatch:
    ids = torch.tensor([[t for s in seqs for t in s]])
    segments = torch.tensor([[i for i, s in enumerate(seqs) for _ in s]])
    positions = torch.tensor([[p for s in seqs for p in range(len(s))]])
    valid = torch.ones_like(ids, dtype=torch.bool)
    return DraftBatch(ids, _hidden(policy, ids, positions, aux, segments), valid, rewards,
                      segments, positions)


@pytest.mark.parametrize("kind,loss,num_steps", [("eagle1", "eagle1", 1), ("eagle1", "eagle1", 2),
                                                 ("eagle3", "eagle3", 3),
                                                 ("eagle1", "reward_kd", 2)])
def test_packed_loss_and_gradients_equal_padded(policy, kind, loss, num_steps):
    torch.manual_seed(0)
    drafter = build_drafter(kind, policy.config, 128).attach(policy)
    seqs, rewards = _sequences(), torch.tensor([1.0, 0.0, 1.0, 0.5])
    results = []
    for make in (_padded, _packed):
        drafter.zero_grad()
        value, metrics = compute_drafter_loss(loss, drafter, make(policy, seqs,
                                                                 drafter.aux_layers, rewards),
                                              policy.lm_head, num_steps=num_steps)
        value.backward()
        results.append((value.detach(), metrics,
                        [p.grad.clone() for p in drafter.parameters() if p.grad is not None]))
    (padded, m_pad, g_pad), (packed, m_pack, g_pack) = results
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    assert len(g_pack) == len(g_pad) > 0
    for a, b in zip(g_pack, g_pad):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert m_pack["top1_acc"] == pytest.approx(m_pad["top1_acc"])
    assert 0 <= m_pack["top1_acc"] <= m_pack["top3_acc"] <= 1


def test_a_pair_never_spans_two_packed_sequences(policy):
    """Packing without segments would score the first token of each sequence from the last
    hidden state of the one before it: a different (wrong) loss."""
    torch.manual_seed(0)
    drafter = build_drafter("eagle1", policy.config, 128).attach(policy)
    seqs = _sequences()
    packed = _packed(policy, seqs, ())
    joined = DraftBatch(packed.input_ids, packed.hidden, packed.valid)
    right, _ = compute_drafter_loss("eagle1", drafter, packed, policy.lm_head)
    wrong, _ = compute_drafter_loss("eagle1", drafter, joined, policy.lm_head)
    assert not torch.allclose(right, wrong)


def test_reward_weights_by_hand():
    w = reward_weights(torch.tensor([1.0, 0.0]), floor=0.1)
    torch.testing.assert_close(w, torch.tensor([1.1 / 0.6, 0.1 / 0.6]))
    assert reward_weights(torch.tensor([5.0, 0.0, 0.0, 0.0]), floor=0.1).max() == 3.0  # clipped
    assert (reward_weights(torch.tensor([-1.0, 0.0])) > 0).all()
    with pytest.raises(ValueError, match="floor"):
        reward_weights(torch.tensor([1.0]), floor=0.0)


def test_reward_kd_follows_the_rewards(policy):
    torch.manual_seed(0)
    drafter = build_drafter("eagle1", policy.config, 128).attach(policy)
    seqs = _sequences()

    def kd(rewards):
        batch = _padded(policy, seqs, (), torch.tensor(rewards))
        return compute_drafter_loss("reward_kd", drafter, batch, policy.lm_head, num_steps=1)

    equal, metrics = kd([1.0, 1.0, 1.0, 1.0])
    plain, _ = compute_drafter_loss("eagle1", drafter, _padded(policy, seqs, ()),
                                    policy.lm_head, num_steps=1)
    assert metrics["kl"] >= 0 and metrics["weight_min"] == metrics["weight_max"] == 1.0
    # Equal rewards: the unweighted soft-CE (eagle1's CE term is 0.1 of its loss).
    assert equal.item() == pytest.approx(metrics["soft_ce_0"])
    assert 0.1 * metrics["soft_ce_0"] < plain.item()
    # Per-sample CE, then: rewarding the worst-drafted sample raises the weighted loss.
    per_sample = [kd([1.0 if i == j else 0.0 for i in range(4)])[0].item() for j in range(4)]
    assert max(per_sample) > equal.item() > min(per_sample)
    with pytest.raises(ValueError, match="needs every sample's reward"):
        compute_drafter_loss("reward_kd", drafter, _padded(policy, seqs, ()), policy.lm_head)


def test_losses_are_registered_and_check_the_drafter_kind(policy):
    assert drafter_loss_names() == ["eagle1", "eagle3", "reward_kd"]
    drafter = build_drafter("eagle3", policy.config, 128).attach(policy)
    with pytest.raises(ValueError, match="trains an eagle1 drafter"):
        compute_drafter_loss("eagle1", drafter, _padded(policy, _sequences(), drafter.aux_layers),
                             policy.lm_head)
    with pytest.raises(ValueError, match="unknown drafter loss"):
        compute_drafter_loss("kd", drafter, _padded(policy, _sequences(), ()), policy.lm_head)


def test_rows_packed_first_fit_give_the_padded_loss(policy):
    """pack_rows (what the SpotTrainer trains on) against pad, through draft_batch."""
    from fastdraft.databuffer import Sample, pack_rows, pad
    from fastdraft.trainer.spot import draft_batch
    torch.manual_seed(0)
    drafter = build_drafter("eagle1", policy.config, 128).attach(policy)
    samples = []
    for i, seq in enumerate(_sequences() * 2):
        ids = torch.tensor([seq])
        hidden = _hidden(policy, ids, torch.arange(len(seq)).unsqueeze(0), ())
        samples.append(Sample(request_index=i, policy_version=0, rl_step=0, token_ids=ids[0],
                              positions=torch.arange(len(seq)), hidden=hidden.final[0],
                              loss_mask=torch.arange(len(seq)) >= 2, reward=float(i % 2)))
    rows = pack_rows(samples)
    assert rows.input_ids.shape[1] == max(LENGTHS) and rows.input_ids.shape[0] < len(samples)
    assert rows.density > pad(samples).density
    values = [compute_drafter_loss(name, drafter, draft_batch(b), policy.lm_head)[0]
              for b in (rows, pad(samples)) for name in ("eagle1", "reward_kd")]
    torch.testing.assert_close(values[0], values[2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values[1], values[3], atol=1e-5, rtol=1e-5)
