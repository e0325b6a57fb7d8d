"""Hidden-state capture: on every path (prefill, plain decode, speculative verify, greedy and
sampled), a request's records pair each committed token with the policy's hidden state of the
token before it, exactly as a fresh causal forward over the whole sequence computes them, up to
the request's last token (EOS or length limit) included."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch

from fastdraft import RolloutEngine, SamplingParams, SpecConfig
from fastdraft.engine.capture import HiddenRecord
from fastdraft.models import load_model

AUX = (0, 1)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(3, 64) for _ in range(6)]  # shared prefixes: suffix drafts get used
    return [base + [rng.randrange(3, 64) for _ in range(rng.randrange(1, 9))] for _ in range(n)]


def _engine(path, method: str, drafter, **kw) -> RolloutEngine:
    spec = SpecConfig(method=method, depth=4, topk=2, tokens_to_verify=6)
    return RolloutEngine(path, max_batch_size=4, max_seq_len=96, spec=spec,
                         drafter=drafter if method == "eagle" else None, **kw)


@pytest.mark.parametrize("method", ["none", "eagle", "suffix", "eagle+budget"])
@pytest.mark.parametrize("greedy", [True, False])
def test_records_pair_every_committed_token_with_the_hidden_state_before_it(
        tiny_checkpoint, random_drafter, monkeypatch, method, greedy):
    """eagle+budget: length-aware budgets with a random split every step (plain rows beside
    tree rows in one forward, slots swapped)."""
    path, _ = tiny_checkpoint
    kw = {}
    if method == "eagle+budget":
        from fastdraft.config.engine import BudgetConfig
        from fastdraft.engine.spec.budget import LengthBudget
        rng = random.Random(2)
        monkeypatch.setattr(LengthBudget, "speculating",
                            lambda self, remaining: [rng.random() < 0.5 for _ in remaining])
        method, kw = "eagle", {"budget": BudgetConfig()}
    engine = _engine(path, method, random_drafter, capture_aux_layers=AUX, **kw)
    prompts = _prompts(7, seed=3)
    # EOS (id 1) ends some answers early, max_new_tokens the others; 7 prompts over 4 slots.
    params = [SamplingParams(greedy=greedy, temperature=1.0, seed=i,
                             max_new_tokens=6 + 3 * i, stop_token_ids=[5 + i])
              for i in range(len(prompts))]
    records: dict[int, list[HiddenRecord]] = defaultdict(list)
    if method == "suffix":  # earlier rollouts of these prompts to draft from
        engine.generate(prompts, params)
        engine.advance_step()
    outs = engine.generate(prompts, params, on_hidden=lambda r: records[r.request_index].append(r))
    policy = load_model(path)
    for out in outs:
        mine = records[out.index]
        sequence = out.prompt_token_ids + out.token_ids
        positions = torch.cat([r.positions for r in mine])
        assert positions.tolist() == list(range(len(sequence) - 1))
        assert torch.cat([r.token_ids for r in mine]).tolist() == sequence[1:]
        assert all(r.policy_version == engine.policy_version for r in mine)
        ids = torch.tensor([sequence[:-1]])
        _, ref = policy(ids, torch.arange(ids.shape[1]).unsqueeze(0), aux_layers=AUX)
        got = torch.cat([r.final for r in mine])
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), ref.final[0], atol=2e-2, rtol=2e-2)
        for i in range(len(AUX)):
            torch.testing.assert_close(torch.cat([r.aux[i] for r in mine]).float(),
                                       ref.aux[i][0], atol=2e-2, rtol=2e-2)
    if method != "none":
        assert sum(c.spec.num_accepted for c in outs) > 0  # verify paths with accepted nodes
    if kw:   # split steps ran
        trace = engine.last_trace
        assert any(0 < n < a for n, a, arm in zip(trace.drafting, trace.active, trace.arms)
                   if arm != "prefill")


def test_capture_changes_no_output_and_costs_nothing_when_off(tiny_checkpoint, random_drafter):
    path, _ = tiny_checkpoint
    prompts = _prompts(5, seed=4)
    params = SamplingParams(temperature=1.0, seed=0, max_new_tokens=12)
    plain = _engine(path, "eagle", random_drafter).generate(prompts, params)
    engine = _engine(path, "eagle", random_drafter)
    seen: list[HiddenRecord] = []
    captured = engine.generate(prompts, params, on_hidden=seen.append)
    assert [c.token_ids for c in captured] == [c.token_ids for c in plain]
    assert seen and all(r.aux == () for r in seen)  # no aux layers asked for
    assert engine.hidden_sink is None  # the sink lives for one call


def test_capture_aux_layers_are_checked(tiny_checkpoint):
    path, _ = tiny_checkpoint
    with pytest.raises(ValueError, match="capture_aux_layers"):
        RolloutEngine(path, max_seq_len=64, capture_aux_layers=(5,))
    with pytest.raises(ValueError, match="one row per token"):
        HiddenRecord(request_index=0, policy_version=0, positions=torch.arange(3),
                     token_ids=torch.arange(2), final=torch.zeros(3, 4), aux=())


class _Picky:
    """A sink that wants only some requests' rows (a byte budget, capture switched off)."""

    def __init__(self, keep: set[int]) -> None:
        self.keep, self.asked, self.records = keep, [], []

    def wants(self, request_indices: list[int], num_tokens: list[int]) -> list[bool]:
        self.asked.append(list(zip(request_indices, num_tokens)))
        return [i in self.keep for i in request_indices]

    def __call__(self, record: HiddenRecord) -> None:
        self.records.append(record)


def test_rows_a_sink_does_not_want_are_neither_copied_nor_emitted(
        tiny_checkpoint, random_drafter, monkeypatch):
    import fastdraft.engine.capture as capture
    path, _ = tiny_checkpoint
    prompts = _prompts(5, seed=6)
    params = SamplingParams(temperature=1.0, seed=0, max_new_tokens=10)
    every: list[HiddenRecord] = []
    _engine(path, "eagle", random_drafter, capture_aux_layers=AUX).generate(
        prompts, params, on_hidden=every.append)
    copied: list[int] = []   # rows copied to the host, per step
    real = capture._to_host
    monkeypatch.setattr(capture, "_to_host", lambda tensors, rows, *a: (
        copied.append(len(rows)), real(tensors, rows, *a))[1])
    sink = _Picky({1, 3})
    _engine(path, "eagle", random_drafter, capture_aux_layers=AUX).generate(
        prompts, params, on_hidden=sink)
    assert {r.request_index for r in sink.records} == {1, 3}
    assert sum(copied) == len(sink.records)   # one row copied per record kept, no more
    assert sum(len(step) for step in sink.asked) > len(sink.records)   # others were refused
    kept = [r for r in every if r.request_index in (1, 3)]   # the same rows as unfiltered
    assert len(kept) == len(sink.records)
    for a, b in zip(kept, sink.records):
        assert torch.equal(a.positions, b.positions) and torch.equal(a.final, b.final)
        assert all(torch.equal(x, y) for x, y in zip(a.aux, b.aux))
