"""SampleCollector within its byte budget: the hidden states of running requests it holds never
exceed the budget, what does not fit is refused before the engine copies it (and counted), and
what was kept still becomes exact samples (contiguous windows, positions kept)."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch

from fastdraft import RolloutEngine, SamplingParams, SpecConfig
from fastdraft.databuffer import DataBuffer
from fastdraft.engine import Completion
from fastdraft.engine.capture import HiddenRecord
from fastdraft.trainer.collector import SampleCollector

H = 4
ROW = 16 + 2 * H   # position + token id (int64) + one bf16 hidden row


class _Watched(SampleCollector):
    """Records what it holds after every record it is handed."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.held_after_each_record: list[int] = []

    def __call__(self, record: HiddenRecord) -> None:
        super().__call__(record)
        self.held_after_each_record.append(self.held_bytes)


def _record(index: int, start: int, n: int) -> HiddenRecord:
    return HiddenRecord(request_index=index, policy_version=0,
                        positions=torch.arange(start, start + n),
                        token_ids=torch.arange(start + 1, start + n + 1),
                        final=torch.arange(start, start + n).float().repeat(H, 1).T.bfloat16(),
                        aux=())


def _emit(collector: SampleCollector, rows: list[tuple[int, int, int]]) -> None:
    """One engine step's rows (index, start, n), as capture.emit_records hands them over."""
    verdicts = collector.wants([i for i, _, _ in rows], [n for _, _, n in rows])
    for (index, start, n), keep in zip(rows, verdicts):
        if keep:
            collector(_record(index, start, n))


def _completion(index: int, prompt_len: int, total: int) -> Completion:
    return Completion(index=index, prompt_token_ids=list(range(prompt_len)),
                      token_ids=list(range(prompt_len, total)), logprobs=[],
                      finish_reason="length", policy_version=0)


def test_whole_requests_are_kept_within_the_budget_not_the_rows_that_fit() -> None:
    """Budget 12 rows: a request is admitted at its first row while at most half of it is
    held; one not admitted is not captured at all; an admitted one that outgrows the budget is
    cut there, its rows so far one sample (never a run after a gap, without its context)."""
    buffer = DataBuffer(2**20)
    collector = SampleCollector(buffer, budget_bytes=12 * ROW, row_bytes=ROW)
    _emit(collector, [(0, 0, 4), (1, 0, 4)])     # 0 admitted (4 <= 6 rows); 1 is not (8 > 6)
    for pos in range(4, 9):
        _emit(collector, [(0, pos, 1), (1, pos, 1)])
    _emit(collector, [(2, 0, 3)])                # arrives at 9 rows held: not admitted
    for pos in range(9, 14):                     # 0 grows to 12 rows, then is cut
        _emit(collector, [(0, pos, 1), (2, pos - 6, 1)])
        assert collector.held_bytes <= 12 * ROW
    collector.on_finish(_completion(1, prompt_len=3, total=10))
    collector.on_finish(_completion(2, prompt_len=3, total=9))
    collector.on_finish(_completion(0, prompt_len=3, total=15))   # positions 0..13
    assert collector.held_bytes == 0 and collector.peak_bytes == 12 * ROW
    assert collector.dropped_tokens == 9 + 8 + 2   # all of 1 and of 2, 0's positions 12, 13
    (sample,) = buffer.samples()
    assert (sample.request_index, sample.start, sample.num_tokens) == (0, 0, 12)
    assert sample.hidden[:, 0].tolist() == sample.positions.float().tolist()   # its own rows
    assert sample.token_ids.tolist() == sample.positions.tolist()   # sequence[t] == t here
    assert sample.loss_mask.tolist() == (sample.positions >= 1).tolist()   # first_drafted_pair
    _emit(collector, [(3, 0, 4)])                # the budget is free again: admitted
    collector.on_finish(_completion(3, prompt_len=3, total=5))
    assert [s.request_index for s in buffer.samples()] == [0, 3]


def test_a_step_that_lost_rows_without_saying_so_is_an_error() -> None:
    collector = SampleCollector(DataBuffer(2**20))
    collector(_record(0, 0, 4))
    collector(_record(0, 6, 2))   # positions 4, 5 never arrived, none was dropped
    with pytest.raises(RuntimeError, match="lost a step"):
        collector.on_finish(_completion(0, prompt_len=3, total=9))


def test_in_an_engine_the_budget_holds_and_kept_states_are_exact(tiny_checkpoint,
                                                                 random_drafter) -> None:
    path, _ = tiny_checkpoint
    engine = RolloutEngine(path, max_batch_size=6, max_seq_len=96, drafter=random_drafter,
                           spec=SpecConfig(method="eagle", depth=3, topk=2, tokens_to_verify=4),
                           capture_aux_layers=(0, 1))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 64) for _ in range(rng.randrange(4, 10))] for _ in range(6)]
    params = SamplingParams(temperature=1.0, seed=0, max_new_tokens=30)
    every: dict[int, list[HiddenRecord]] = defaultdict(list)
    engine.generate(prompts, params, on_hidden=lambda r: every[r.request_index].append(r))
    row = 16 + 2 * engine.config.hidden_size * 3
    budget = 60 * row   # well under the rollout's ~6 x 38 rows
    buffer = DataBuffer(2**24)
    collector = _Watched(buffer, budget_bytes=budget, row_bytes=row)
    outs = engine.generate(prompts, params, on_hidden=collector, on_finish=collector.on_finish)
    peaks = collector.held_after_each_record
    assert max(peaks) <= budget and collector.dropped_tokens > 0
    total = sum(len(c.prompt_token_ids) + len(c.token_ids) - 1 for c in outs)
    kept = sum(s.num_tokens for s in buffer.samples())
    assert 0 < kept <= total - collector.dropped_tokens
    for s in buffer.samples():   # each window: the states of those positions, as uncut
        final = torch.cat([r.final for r in every[s.request_index]])
        aux = [torch.cat([r.aux[i] for r in every[s.request_index]]) for i in range(2)]
        assert torch.equal(s.hidden, final[s.positions])
        assert all(torch.equal(a, b[s.positions]) for a, b in zip(s.aux_hidden, aux))

