"""Chunked prefill (rollout.prefill_chunk_tokens): a prompt longer than the chunk (or the
re-prefill of a preempted request's prompt + answer) is prefilled a chunk per step in a staging
slot, the running requests decoding between its chunks, and lands in its slots at the last one.
Completions, logprobs and the captured hidden states are those of one-shot prefill."""

from __future__ import annotations

import pytest
import torch

from fastdraft.config.engine import SpecConfig
from fastdraft.engine import RolloutEngine, SamplingParams
from fastdraft.engine.envelope import Envelope
from fastdraft.engine.memory_plan import plan_engine
from fastdraft.engine.request import Request
from fastdraft.engine.sampling_params import SamplingParams as Params
from fastdraft.engine.scheduler import Phase, Scheduler
from fastdraft.errors import FastdraftError
from fastdraft.models import ModelConfig

EAGLE = SpecConfig(method="eagle", depth=3, topk=2, tokens_to_verify=6)
CHUNK = 16


def _prompts() -> list[list[int]]:
    """Short prompts, a GRPO group of a long one, and long singles (up to 4 chunks)."""
    g = torch.Generator().manual_seed(11)
    tokens = lambda n: torch.randint(3, 60, (n,), generator=g).tolist()  # noqa: E731
    return [tokens(5), tokens(12), *[tokens(40)] * 3, tokens(61), tokens(17), tokens(9),
            tokens(33)]


def _spy(engine: RolloutEngine) -> list[str]:
    """The order of the runner's forwards: 'chunk lo-hi', 'prefill', 'step'."""
    log, runner = [], engine.runner
    for name in ("prefill_staged", "prefill_shared", "decode", "verify", "verify_split"):
        real = getattr(runner, name)

        def call(*args, _real=real, _name=name, **kwargs):
            log.append(f"chunk {args[1]}-{args[2]}" if _name == "prefill_staged" else
                       "prefill" if _name == "prefill_shared" else "step")
            return _real(*args, **kwargs)
        setattr(runner, name, call)
    return log


def _records(records) -> dict[tuple[int, int], torch.Tensor]:
    return {(r.request_index, int(p)): r.final[i] for r in records
            for i, p in enumerate(r.positions)}


@pytest.mark.parametrize("block_size", [0, 8], ids=["static", "paged"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chunked_prefill_completes_as_one_shot_with_speculation(tiny_checkpoint, random_drafter,
                                                                block_size, temperature):
    path, _ = tiny_checkpoint
    engines = [RolloutEngine(path, "cpu", max_batch_size=4, max_seq_len=128, spec=EAGLE,
                             drafter=random_drafter, kv_block_size=block_size,
                             prefill_chunk_tokens=chunk) for chunk in (0, CHUNK)]
    log = _spy(engines[1])
    params = SamplingParams(temperature=temperature, max_new_tokens=30, seed=5)
    captured: list[list] = [[], []]
    one_shot, chunked = (e.generate(_prompts(), params, use_tqdm=False, on_hidden=c.append)
                         for e, c in zip(engines, captured))
    assert [c.token_ids for c in chunked] == [c.token_ids for c in one_shot]
    got, want = (torch.tensor([lp for c in out for lp in c.logprobs]) for out in (chunked,
                                                                                   one_shot))
    assert torch.allclose(got, want, atol=1e-5)
    a, b = (_records(c) for c in captured)   # the drafter's training data: the same states
    assert a.keys() == b.keys()   # (kept in half precision: equal within a rounding step)
    worst = max((a[k].float() - b[k].float()).abs().max() / a[k].float().abs().max() for k in a)
    assert worst < 2e-3, worst
    # The 61-token prompt ran in 4 chunks, decode steps of the running requests between them.
    assert [e for e in log if e.startswith("chunk")].count("chunk 48-61") == 1
    last = log.index("chunk 48-61")
    first = last - log[last::-1].index("chunk 0-16")
    assert "step" in log[first:last] and "prefill" not in log[first:last]
    assert engines[1].last_trace.prefill_computed < engines[1].last_trace.prefill_tokens


def test_a_preempted_long_request_resumes_exactly_through_chunks(tiny_checkpoint,
                                                                 random_drafter):
    path, _ = tiny_checkpoint
    kwargs = dict(max_batch_size=6, max_seq_len=128, kv_block_size=8, spec=EAGLE,
                  drafter=random_drafter)
    roomy = RolloutEngine(path, "cpu", **kwargs)
    tight = RolloutEngine(path, "cpu", kv_blocks=40, prefill_chunk_tokens=CHUNK, **kwargs)
    log = _spy(tight)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (6, 9, 20, 7, 12, 8)]
    params = SamplingParams(temperature=1.0, max_new_tokens=90, ignore_eos=True, seed=7)
    expected = roomy.generate(prompts, params, use_tqdm=False)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.last_trace.preemptions >= 1
    # a re-prefill (prompt + answer so far) longer than a chunk went through the staging slot
    assert any(e.startswith("chunk") and not e.startswith("chunk 0-") for e in log)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert torch.allclose(torch.tensor([lp for c in got for lp in c.logprobs]),
                          torch.tensor([lp for c in expected for lp in c.logprobs]), atol=1e-5)


def _request(index: int, prompt: list[int]) -> Request:
    return Request(index, prompt, Params(max_new_tokens=4), frozenset(), 100, index)


def test_the_scheduler_stages_a_long_prompt_with_its_group_and_alternates_with_decode():
    sched = Scheduler(num_slots=8, max_prefill_tokens=10, chunk_tokens=10)
    sched.add(_request(0, [1] * 3))
    assert sched.schedule().phase is Phase.PREFILL
    long = [5] * 25
    for i in (1, 2, 3):
        sched.add(_request(i, long))
    sched.add(_request(4, [7] * 25))   # as long, another prompt: waits for the next staging
    steps = [sched.schedule() for _ in range(5)]
    assert [(b.phase, b.chunk) for b in steps] == [
        (Phase.PREFILL, (0, 10)), (Phase.DECODE, None), (Phase.PREFILL, (10, 20)),
        (Phase.DECODE, None), (Phase.PREFILL, (20, 25))]
    assert [r.index for r in steps[0].requests] == [1, 2, 3]
    assert [r.slot for r in steps[4].requests] == [1, 2, 3]   # slots only at the last chunk
    assert [r.index for r in sched.running] == [0, 1, 2, 3]
    assert sched.schedule().chunk == (0, 10) and [r.index for r in sched.unfinished] == [
        0, 1, 2, 3, 4]


def test_a_chunk_bounds_the_planned_prefill_and_adds_one_staging_slot():
    cfg = ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                      num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                      head_dim=128, model_type="qwen2")
    env = Envelope.for_spec(17408, SpecConfig())
    one_shot, chunked = (plan_engine(cfg, envelope=env, num_slots=64, dtype=torch.bfloat16,
                                     device="cuda", spec=SpecConfig(), graphs=False,
                                     kv_block_size=16, prefill_chunk_tokens=c)
                         for c in (0, 4096))
    assert chunked.step_scratch < one_shot.step_scratch / 3
    assert chunked.shape.num_kv_blocks == one_shot.shape.num_kv_blocks + 17408 // 16


def test_a_negative_chunk_is_refused(tiny_checkpoint):
    with pytest.raises(FastdraftError, match="prefill_chunk_tokens"):
        RolloutEngine(tiny_checkpoint[0], "cpu", max_seq_len=64, prefill_chunk_tokens=-1)
