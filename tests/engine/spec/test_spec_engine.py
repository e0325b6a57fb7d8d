"""The speculative engine end to end on tiny random models: output equals plain decoding."""

from __future__ import annotations

import random

import pytest
import torch

from fastdraft import RolloutEngine, SamplingParams
from fastdraft.config.engine import SpecConfig
from fastdraft.drafter import build_drafter, save_drafter
from fastdraft.engine.spec.batch import DraftBatch
from fastdraft.engine.spec.proposer import Proposer
from fastdraft.engine.spec.tree import DraftTree
from fastdraft.models import load_model


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 64) for _ in range(rng.randrange(1, 25))] for _ in range(n)]


class OracleProposer(Proposer):
    """Drafts trees that contain the true greedy continuation (known in advance) among random
    distractor branches, so every accept/compaction path of the engine gets exercised."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], seed: int,
                 wrong_rate: float) -> None:
        self.refs, self.rng, self.wrong_rate = references, random.Random(seed), wrong_rate

    def propose(self, requests, cfg):
        return DraftBatch.from_trees([self._tree(r, cfg) for r in requests])

    def _tree(self, r, cfg) -> DraftTree:
        truth = self.refs[tuple(r.prompt_token_ids)][len(r.output_token_ids):]
        tokens, parents = [], []
        parent = -1
        for depth, tok in enumerate(truth[: cfg.depth]):
            for _ in range(self.rng.randrange(cfg.topk)):  # distractor siblings first or later
                if len(tokens) < cfg.tokens_to_verify:
                    tokens.append(self.rng.randrange(64))
                    parents.append(parent)
            if len(tokens) >= cfg.tokens_to_verify:
                break
            if self.rng.random() < self.wrong_rate and depth > 0:
                tok = (tok + 1) % 64  # a wrong guess ends the useful chain
            tokens.append(tok)
            parents.append(parent)
            parent = len(tokens) - 1
        return DraftTree(torch.tensor(tokens, dtype=torch.long),
                         torch.tensor(parents, dtype=torch.long), None, None,
                         torch.zeros(len(tokens), dtype=torch.int8))


@pytest.mark.parametrize("depth, topk, ttv, batch", [(1, 1, 1, 1), (4, 1, 4, 3), (5, 3, 16, 8),
                                                     (6, 8, 64, 5)])
def test_greedy_with_oracle_trees_equals_plain_greedy(tiny_checkpoint, depth, topk, ttv, batch):
    path, _ = tiny_checkpoint
    prompts = _prompts(10, seed=depth)
    params = SamplingParams(greedy=True, max_new_tokens=30)
    plain = RolloutEngine(path, max_batch_size=batch, max_seq_len=96).generate(prompts, params)
    refs = {tuple(p): c.token_ids for p, c in zip(prompts, plain)}
    spec = SpecConfig(method="suffix", depth=depth, topk=topk, tokens_to_verify=ttv)
    engine = RolloutEngine(path, max_batch_size=batch, max_seq_len=96, spec=spec)
    engine.proposer = OracleProposer(refs, seed=depth, wrong_rate=0.2)
    outs = engine.generate(prompts, params)
    assert [c.token_ids for c in outs] == [c.token_ids for c in plain]
    for o, p in zip(outs, plain):
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(p.logprobs),
                                   atol=1e-4, rtol=0)
        assert o.finish_reason == p.finish_reason
    stats = engine.last_stats
    assert stats.num_accepted > 0 and stats.accept_length > 1.0
    if depth > 1:
        assert stats.accept_length > 1.5


@pytest.mark.parametrize("depth, topk, ttv", [(1, 1, 1), (3, 1, 3), (4, 2, 8), (5, 8, 64)])
def test_greedy_eagle_equals_plain_greedy(tiny_checkpoint, random_drafter, depth, topk, ttv):
    path, _ = tiny_checkpoint
    prompts = _prompts(9, seed=1)
    params = SamplingParams(greedy=True, max_new_tokens=24)
    plain = RolloutEngine(path, max_batch_size=4, max_seq_len=96).generate(prompts, params)
    spec = SpecConfig(method="eagle", depth=depth, topk=topk, tokens_to_verify=ttv)
    engine = RolloutEngine(path, max_batch_size=4, max_seq_len=96, spec=spec,
                           drafter=random_drafter)
    outs = engine.generate(prompts, params)
    assert [c.token_ids for c in outs] == [c.token_ids for c in plain]
    assert all(c.spec is not None and c.spec.num_verify_steps > 0 for c in outs)


def test_greedy_eagle_over_a_draft_vocabulary_equals_plain_greedy(tiny_checkpoint,
                                                                   random_drafter):
    """A drafter that scores only half the tokens (its draft vocabulary, saved with it) still
    gives exactly plain greedy decoding; its drafts only ever hold draft-vocabulary tokens."""
    from fastdraft.drafter import load_drafter, save_drafter
    path, _ = tiny_checkpoint
    policy = load_model(path)
    drafter = load_drafter(random_drafter, policy, 256)
    drafter.draft_token_ids = torch.arange(0, 64, 2)
    subset_dir = path.parent / "drafter-subset"
    save_drafter(drafter, subset_dir)
    prompts = _prompts(6, seed=4)
    params = SamplingParams(greedy=True, max_new_tokens=20)
    plain = RolloutEngine(path, max_batch_size=4, max_seq_len=96).generate(prompts, params)
    spec = SpecConfig(method="eagle", depth=4, topk=2, tokens_to_verify=8)
    engine = RolloutEngine(path, max_batch_size=4, max_seq_len=96, spec=spec,
                           drafter=subset_dir)
    assert engine.proposer.head.vocab_size == 32  # type: ignore[attr-defined]
    drafted = []
    real_store = engine.io.drafts.store  # type: ignore[union-attr]

    def store(drafts, batch, width):
        drafted.append(drafts.tokens.clone())
        return real_store(drafts, batch, width)
    engine.io.drafts.store = store  # type: ignore[union-attr]
    outs = engine.generate(prompts, params)
    assert [c.token_ids for c in outs] == [c.token_ids for c in plain]
    assert drafted and all(bool((t % 2 == 0).all()) for t in drafted)


def test_sampling_eagle_runs_and_reports_policy_logprobs(tiny_checkpoint, random_drafter):
    path, hf = tiny_checkpoint
    spec = SpecConfig(method="eagle", depth=3, topk=2, tokens_to_verify=6)
    engine = RolloutEngine(path, max_batch_size=4, max_seq_len=96, spec=spec,
                           drafter=random_drafter)
    prompts = _prompts(4, seed=2)
    outs = engine.generate(prompts, SamplingParams(temperature=0.8, top_p=0.9, seed=1,
                                                   max_new_tokens=20))
    for prompt, out in zip(prompts, outs):
        seq = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logits = hf(seq).logits[0, len(prompt) - 1: -1] / 0.8
        ref = logits.log_softmax(-1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)


def test_mixed_greedy_and_sampled_batch_keeps_greedy_rows_exact(tiny_checkpoint, random_drafter):
    """Greedy and filtered sampling requests share one batch (and one draft expansion): the
    greedy rows still equal plain greedy decoding, the sampled rows report policy logprobs."""
    path, hf = tiny_checkpoint
    prompts = _prompts(8, seed=3)
    greedy = SamplingParams(greedy=True, max_new_tokens=20)
    sampled = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=4, max_new_tokens=20)
    per_request = [greedy if i % 2 == 0 else sampled for i in range(len(prompts))]
    plain = RolloutEngine(path, max_batch_size=4, max_seq_len=96).generate(prompts, greedy)
    spec = SpecConfig(method="eagle", depth=4, topk=3, tokens_to_verify=10)
    engine = RolloutEngine(path, max_batch_size=4, max_seq_len=96, spec=spec,
                           drafter=random_drafter)
    outs = engine.generate(prompts, per_request)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        if i % 2 == 0:
            assert out.token_ids == plain[i].token_ids
            continue
        seq = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logits = hf(seq).logits[0, len(prompt) - 1: -1] / 0.7
        ref = logits.log_softmax(-1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)
        top5 = logits.topk(5, dim=-1).indices
        assert all(t in row for t, row in zip(out.token_ids, top5.tolist()))  # top_k held


@pytest.mark.parametrize("depth, topk, ttv", [(6, 3, 12), (4, 8, 30)])
def test_trees_at_the_end_of_the_cache(tiny_checkpoint, random_drafter, depth, topk, ttv):
    """Answers that run into max_seq_len: draft nodes and scratch cells sit past the last
    committed cell; greedy still equals plain greedy and no answer outgrows the cache."""
    path, _ = tiny_checkpoint
    prompts = _prompts(8, seed=5)
    spec = SpecConfig(method="eagle", depth=depth, topk=topk, tokens_to_verify=ttv)
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=1, max_new_tokens=100,
                                ignore_eos=True)
        engine = RolloutEngine(path, max_batch_size=4, max_seq_len=28, spec=spec,
                               drafter=random_drafter)
        outs = engine.generate(prompts, params)
        assert all(len(p) + len(o.token_ids) == 28 for p, o in zip(prompts, outs))
        if temperature == 0.0:
            plain = RolloutEngine(path, max_batch_size=4, max_seq_len=28).generate(prompts,
                                                                                 params)
            assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_mismatched_drafter_is_refused(tiny_checkpoint, tmp_path):
    from tests.conftest import make_tiny_checkpoint
    make_tiny_checkpoint(tmp_path / "wide", hidden_size=96)
    wide = load_model(tmp_path / "wide")
    drafter = build_drafter("eagle1", wide.config, 128).attach(wide)
    save_drafter(drafter, tmp_path / "d")
    with pytest.raises(ValueError, match="hidden_size: drafter 96 vs policy 64"):
        RolloutEngine(tiny_checkpoint[0], max_seq_len=64, drafter=tmp_path / "d",
                      spec=SpecConfig(method="eagle"))
    with pytest.raises(ValueError, match="needs drafter"):
        RolloutEngine(tiny_checkpoint[0], max_seq_len=64, spec=SpecConfig(method="eagle"))


@pytest.mark.parametrize("depth, ttv", [(1, 1), (4, 4), (8, 32)])
def test_greedy_suffix_equals_plain_and_learns_from_earlier_rollouts(tiny_checkpoint, depth, ttv):
    path, _ = tiny_checkpoint
    prompts = _prompts(6, seed=3)
    params = SamplingParams(greedy=True, max_new_tokens=40)
    plain = RolloutEngine(path, max_batch_size=4, max_seq_len=96).generate(prompts, params)
    spec = SpecConfig(method="suffix", depth=depth, topk=4, tokens_to_verify=ttv)
    engine = RolloutEngine(path, max_batch_size=4, max_seq_len=96, spec=spec)
    first = engine.generate(prompts, params)
    engine.advance_step()
    second = engine.generate(prompts, params)  # the same prompts again: earlier rollouts match
    for outs in (first, second):
        assert [c.token_ids for c in outs] == [c.token_ids for c in plain]
    assert engine.last_stats.accept_length > 1.5
    assert engine.last_stats.accepted_by_source.get("suffix", 0) > 0


def test_stats_count_only_accepted_tokens_the_request_kept(tiny_checkpoint):
    """A path that runs past the length limit (or a stop token) is cut there: what lies beyond
    is not output, so it is not counted as accepted either."""
    path, _ = tiny_checkpoint
    prompts = _prompts(6, seed=11)
    plain = RolloutEngine(path, max_batch_size=3, max_seq_len=96).generate(
        prompts, SamplingParams(greedy=True, max_new_tokens=30, ignore_eos=True))
    refs = {tuple(p): c.token_ids for p, c in zip(prompts, plain)}
    spec = SpecConfig(method="suffix", depth=6, topk=1, tokens_to_verify=6)
    engine = RolloutEngine(path, max_batch_size=3, max_seq_len=96, spec=spec)
    engine.proposer = OracleProposer(refs, seed=0, wrong_rate=0.0)  # drafts run 30 tokens deep
    outs = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=9,
                                                   ignore_eos=True))
    assert [c.token_ids for c in outs] == [c.token_ids[:9] for c in plain]
    for c in outs:
        # 1 token from prefill, then per verify step the kept accepted tokens plus a bonus
        # token, except that the last step's bonus may be cut
        made = 1 + c.spec.num_accepted + c.spec.num_verify_steps
        assert made - 1 <= len(c.token_ids) <= made
    total = sum(len(c.token_ids) for c in outs)
    assert engine.last_stats.num_accepted < total
