from __future__ import annotations

import random

import pytest
import torch

from fastdraft.config.engine import SpecConfig
from fastdraft.drafter import build_drafter, load_drafter, save_drafter
from fastdraft.drafter.losses import (
    DEFAULT_NUM_STEPS,
    ce_target,
    drafter_loss,
    eagle1_loss,
    soft_ce,
    ttt_mask,
)
from fastdraft.drafter.warmup import (
    WarmupConfig,
    _batches,
    first_drafted_pair,
    frequent_tokens,
    train_drafter,
)
from fastdraft.engine.envelope import Envelope
from fastdraft.engine.request import Request
from fastdraft.engine.sampling_params import SamplingParams
from fastdraft.engine.spec.eagle import EagleProposer
from fastdraft.engine.step_io import SamplingMode, StepIO
from fastdraft.models import HiddenStates, load_model
from tests.conftest import make_tiny_checkpoint


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    path = tmp_path_factory.mktemp("policy")
    make_tiny_checkpoint(path, num_hidden_layers=4)
    model = load_model(path)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def test_eagle1_pairs_token_t_plus_1_with_hidden_t(policy):
    drafter = build_drafter("eagle1", policy.config, 64).attach(policy)
    ids = torch.randint(3, 64, (2, 7))
    _, hidden = policy(ids, torch.arange(7).expand(2, -1))
    seen = {}

    def spy(features, input_ids, positions, kv=None, attn=None):
        seen.update(features=features, input_ids=input_ids, positions=positions)
        return features, torch.zeros(*input_ids.shape, 64)

    drafter.step = spy
    eagle1_loss(drafter, ids, hidden, torch.ones(2, 7, dtype=torch.bool), policy.lm_head,
                num_steps=1)
    torch.testing.assert_close(seen["features"], hidden.final[:, :-1])
    assert torch.equal(seen["input_ids"], ids[:, 1:])
    assert torch.equal(seen["positions"][0], torch.arange(1, 7))


def test_ttt_mask_is_what_a_draft_node_sees():
    m = ttt_mask(3, 4, torch.device("cpu")).int()
    # step 2, index 1: real pairs 0..1, then index 1 of steps 1 and 2
    assert m[2 * 4 + 1].tolist() == [1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0]
    assert m[0].tolist() == [1] + [0] * 11


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_training_reduces_loss_and_detaches_the_policy(policy, kind):
    torch.manual_seed(0)
    drafter = build_drafter(kind, policy.config, 128).attach(policy)
    seqs = [torch.randint(3, 64, (12,)).tolist() * 2 for _ in range(16)]  # repetitive: learnable
    ids = torch.tensor(seqs)
    valid = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        _, hidden = policy(ids, torch.arange(24).expand(16, -1), aux_layers=drafter.aux_layers)
    before, _ = drafter_loss(drafter, ids, hidden, valid, policy.lm_head)
    train_drafter(drafter, policy, seqs, WarmupConfig(kind=kind, steps=60, batch_size=16,
                                                      warmup_steps=5), log=lambda s: None)
    after, _ = drafter_loss(drafter, ids, hidden, valid, policy.lm_head)
    # soft-CE against a random policy has a high entropy floor: EAGLE-3 (CE only) moves less
    assert after.item() < (0.7 if kind == "eagle1" else 0.95) * before.item()
    assert all(p.grad is None for p in policy.parameters())


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_cached_drafting_equals_uncached_forward(policy, kind):
    """The proposer's slot cache (prefill commit, a draft tree, then a step's commit) reproduces
    the drafter's plain causal forward over the same pairs: cache cells and masks line up."""
    torch.manual_seed(1)
    drafter = build_drafter(kind, policy.config, 256).attach(policy).eval()
    envelope = Envelope(max_seq_len=40, max_depth=3, max_topk=2, max_tree_nodes=6)
    prop = EagleProposer(drafter=drafter, num_slots=3, envelope=envelope)
    io = StepIO(3, envelope, policy.config.hidden_size, len(drafter.aux_layers),
                policy.config.vocab_size, torch.device("cpu"), torch.float32)
    seq = torch.randint(3, 64, (1, 14))
    with torch.no_grad():
        _, hidden = policy(seq, torch.arange(14)[None], aux_layers=drafter.aux_layers)
        feats = drafter.target_features(hidden)
        _, ref_logits = drafter.step(feats[:, :-1], seq[:, 1:], torch.arange(1, 14)[None])
    req = Request(0, seq[0, :9].tolist(), SamplingParams(greedy=True), frozenset(), 40)
    prefix = HiddenStates(hidden.final[:, :9], tuple(a[:, :9] for a in hidden.aux))
    prop.on_prefill([req], prefix, 0, seq[0, 9:10])  # the first token: seq[9]
    torch.testing.assert_close(prop.root_logits(1)[0], ref_logits[0, 8], atol=1e-4, rtol=0)
    io.load([int(seq[0, 9])], [9], batch=1)
    cfg = SpecConfig(method="eagle", depth=3, topk=2, tokens_to_verify=6)
    ctx_len = 9 + 1 + envelope.tree_cells
    with torch.no_grad():  # a draft tree writes scratch cells that the commit must overwrite
        prop.draft(io, 1, ctx_len, cfg, SamplingMode.GREEDY)
        io.accepted_ids[0] = seq[0, 10:14]      # three accepted tokens + the bonus
        io.num_accepted[0] = 3
        io.commit_final[0] = hidden.final[0, 9:13]
        for buf, a in zip(io.commit_aux, hidden.aux):
            buf[0] = a[0, 9:13]
        prop.commit(io, 1, ctx_len)
    torch.testing.assert_close(prop.root_logits(1)[0], ref_logits[0, 12], atol=1e-4, rtol=0)


def test_checkpoint_roundtrip_and_mismatch(policy, tmp_path):
    drafter = build_drafter("eagle3", policy.config, 64).attach(policy)
    drafter.draft_token_ids = torch.tensor([1, 4, 9])
    save_drafter(drafter, tmp_path / "d")
    again = load_drafter(tmp_path / "d", policy, 64)
    assert again.kind == "eagle3" and again.draft_token_ids.tolist() == [1, 4, 9]
    for (n, a), (_, b) in zip(drafter.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
    assert not any("embed" in n or "lm_head" in n for n in again.state_dict())
    make_tiny_checkpoint(tmp_path / "other", vocab_size=80)
    other = load_model(tmp_path / "other")
    with pytest.raises(ValueError, match="vocab_size: drafter 64 vs policy 80"):
        load_drafter(tmp_path / "d", other, 64)
    with pytest.raises(FileNotFoundError, match=r"drafter_config\.json"):
        load_drafter(tmp_path / "missing", policy, 64)
    weights = tmp_path / "d" / "model.safetensors"   # damaged on disk, size unchanged
    with weights.open("r+b") as f:
        f.seek(weights.stat().st_size - 8)
        f.write(b"\x7f" * 8)
    with pytest.raises(ValueError, match=r"d/model\.safetensors: its bytes differ"):
        load_drafter(tmp_path / "d", policy, 64)


def _random_eagle1_batch(policy, seed: int):
    """An untrained EAGLE-1 drafter and a random [2, 9] batch with the policy's hidden states."""
    torch.manual_seed(seed)
    drafter = build_drafter("eagle1", policy.config, 64).attach(policy)
    ids = torch.randint(3, 64, (2, 9))
    with torch.no_grad():
        _, hidden = policy(ids, torch.arange(9).expand(2, -1))
    return drafter, ids, hidden, torch.ones_like(ids, dtype=torch.bool)


def test_unrolled_eagle1_scores_every_step_and_step0_is_classic_eagle1(policy):
    drafter, ids, hidden, valid = _random_eagle1_batch(policy, seed=2)
    with torch.no_grad():
        one, m1 = eagle1_loss(drafter, ids, hidden, valid, policy.lm_head, num_steps=1)
        three, m3 = eagle1_loss(drafter, ids, hidden, valid, policy.lm_head, num_steps=3)
    assert {"regression_0", "soft_ce_0", "top1_acc_0"} <= m1.keys()
    assert {"regression_2", "soft_ce_2", "top1_acc_2"} <= m3.keys()
    # Step 0 sees the same pairs either way (the TTT mask's first block is causal).
    assert m3["soft_ce_0"] == pytest.approx(m1["soft_ce_0"], abs=1e-5)
    assert m3["regression_0"] == pytest.approx(m1["regression_0"], abs=1e-6)
    assert three.item() > one.item()


def test_response_only_batches_score_from_the_first_drafted_pair():
    assert first_drafted_pair(5) == 3 and first_drafted_pair(1) == 0
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4]]
    ids, valid = next(_batches(seqs, 2, random.Random(0), score_from=[3, 1]))
    rows = {tuple(r.tolist()): v.tolist() for r, v in zip(ids, valid)}
    assert rows[(1, 2, 3, 4, 5, 6)] == [False, False, False, True, True, True]
    assert rows[(1, 2, 3, 4, 0, 0)] == [False, True, True, True, False, False]
    with pytest.raises(ValueError, match="ttt_steps"):
        WarmupConfig(ttt_steps=0)


def test_warmup_config_records_the_kinds_unrolled_steps():
    assert WarmupConfig(kind="eagle1").ttt_steps == DEFAULT_NUM_STEPS["eagle1"] == 2
    assert WarmupConfig(kind="eagle3").ttt_steps == DEFAULT_NUM_STEPS["eagle3"] == 3
    assert WarmupConfig(kind="eagle1", ttt_steps=1).ttt_steps == 1
    with pytest.raises(ValueError, match="unknown drafter kind"):
        WarmupConfig(kind="medusa")


def test_ce_target_mixes_in_the_policys_argmax():
    p = torch.tensor([[0.45, 0.40, 0.15], [0.1, 0.2, 0.7]])
    assert torch.equal(ce_target(p, 0.0), p)
    mixed = ce_target(p, 0.5)
    torch.testing.assert_close(mixed, torch.tensor([[0.725, 0.20, 0.075], [0.05, 0.10, 0.85]]))
    torch.testing.assert_close(mixed.sum(-1), torch.ones(2))
    assert torch.equal(ce_target(p, 1.0).argmax(-1), p.argmax(-1))
    # a drafter that ranks the two near-tied tokens the wrong way round costs more against the
    # mixed target than against p alone
    wrong = torch.tensor([[0.40, 0.45, 0.15]]).log()
    right = torch.tensor([[0.45, 0.40, 0.15]]).log()
    gap = soft_ce(wrong, p[:1]) - soft_ce(right, p[:1])
    mixed_gap = soft_ce(wrong, mixed[:1]) - soft_ce(right, mixed[:1])
    assert mixed_gap > gap > 0


def test_argmax_weight_reaches_the_loss_and_is_checked(policy):
    drafter, ids, hidden, valid = _random_eagle1_batch(policy, seed=3)
    with torch.no_grad():
        _, m0 = drafter_loss(drafter, ids, hidden, valid, policy.lm_head)
        _, m1 = drafter_loss(drafter, ids, hidden, valid, policy.lm_head, argmax_weight=0.5)
    assert m1["soft_ce_0"] != pytest.approx(m0["soft_ce_0"])
    assert m1["regression_0"] == pytest.approx(m0["regression_0"])  # only the CE target moves
    assert WarmupConfig(argmax_weight=0.5).argmax_weight == 0.5
    with pytest.raises(ValueError, match="argmax_weight"):
        WarmupConfig(argmax_weight=1.5)


def test_draft_vocabulary_is_the_most_frequent_answer_tokens():
    seqs = [[9, 9, 9, 1, 2, 2, 3], [9, 9, 2, 5, 5, 5]]
    # answers start at score_from + 2: [1, 2, 2, 3] and [5, 5, 5, 2]
    assert frequent_tokens(seqs, 2, score_from=[1, 0]).tolist() == [2, 5]
    assert frequent_tokens(seqs, 10, score_from=[1, 0]).tolist() == [1, 2, 3, 5]
    assert frequent_tokens(seqs, 1).tolist() == [9]
    with pytest.raises(ValueError, match="draft_vocab"):
        WarmupConfig(draft_vocab=0)
