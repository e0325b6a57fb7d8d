"""Graph-static steps on the CPU: every step's device work runs as stages that never wait on
the host nor copy from it (counted here), results come back in one transfer per step, and
padding a batch to a bucket (free slots as extra rows, masked cells as extra context) changes
no output."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastdraft import RolloutEngine, SamplingParams
from fastdraft.config.engine import SpecConfig, TunerBucket, TunerConfig, parse_arm
from fastdraft.engine.buckets import BucketPlan
from fastdraft.engine.step_io import StepIO

aten = torch.ops.aten
# Ops that make the host wait for the device: a scalar read, or an output whose size depends
# on the data.
SYNC_OPS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default,
            aten.nonzero.default, aten.masked_select.default,
            aten.repeat_interleave.Tensor, aten._unique2.default, aten.unique_dim.default,
            aten.unique_consecutive.default}
# A tensor made from Python data (torch.tensor([...]) inside a stage): a copy from the host,
# which a CUDA graph capture refuses ("Cannot copy between CPU and CUDA tensors during CUDA
# graph capture"; an H200 found one in accept_sampled). A 0-dim one is a scalar (`x[i] = 0`),
# which reaches the kernel as an argument: allowed.
HOST_DATA_OPS = {aten.lift_fresh.default, aten.lift_fresh_copy.default}


class SyncCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNC_OPS or (func in HOST_DATA_OPS and args[0].dim() > 0):
            self.syncs.append(str(func))
        return func(*args, **(kwargs or {}))


@contextmanager
def counting_syncs(engine: RolloutEngine, monkeypatch):
    """Runs every stage of `engine` under a SyncCounter (and counts Tensor.tolist, which reads
    memory directly); also counts the steps' device -> host transfers."""
    counter, transfers = SyncCounter(), []
    real_tolist, real_run, real_read = torch.Tensor.tolist, engine.graphs.run, StepIO.read_out
    inside = [False]

    def tolist(self):
        if inside[0]:
            counter.syncs.append("Tensor.tolist")
        return real_tolist(self)

    def run(key, stage):
        def counted():
            inside[0] = True
            try:
                with counter:
                    stage()
            finally:
                inside[0] = False
        return real_run(key, counted)

    def read_out(self, num_rows):
        transfers.append(num_rows)
        return real_read(self, num_rows)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    monkeypatch.setattr(engine.graphs, "run", run)
    monkeypatch.setattr(StepIO, "read_out", read_out)
    yield counter, transfers


def _prompts(n: int = 7) -> list[list[int]]:
    return [[3 + (5 * i + j) % 60 for j in range(2 + (3 * i) % 11)] for i in range(n)]


MIXED = [SamplingParams(greedy=True, max_new_tokens=12),
         SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_new_tokens=12),
         SamplingParams(temperature=1.0, top_k=5, seed=2, max_new_tokens=12),
         SamplingParams(temperature=1.2, seed=3, max_new_tokens=12)]


def _params(kind: str, n: int) -> list[SamplingParams]:
    if kind == "greedy":
        return [SamplingParams(greedy=True, max_new_tokens=12)] * n
    return [MIXED[i % len(MIXED)] for i in range(n)]


@pytest.mark.parametrize("method", ["none", "eagle", "suffix", "eagle+tuner"])
@pytest.mark.parametrize("kind", ["greedy", "mixed"])
def test_no_host_sync_inside_a_step_and_one_transfer_out(tiny_checkpoint, random_drafter,
                                                         monkeypatch, method, kind):
    """eagle+tuner: a random arm per step, plain steps feeding the drafter included."""
    path, _ = tiny_checkpoint
    tuner = None
    if method == "eagle+tuner":
        method = "eagle"
        tuner = TunerConfig(buckets=(TunerBucket(min_batch=1, arms=tuple(
            parse_arm(a) for a in ("off", "eagle/3/2/6", "eagle/1/2/2"))),), epsilon=1.0)
    spec = SpecConfig(method=method, depth=3, topk=2, tokens_to_verify=6)
    engine = RolloutEngine(path, max_batch_size=4, max_seq_len=64, spec=spec,
                           drafter=random_drafter if method == "eagle" else None, tuner=tuner)
    engine.eager_shortcuts = False  # the path captured graphs run (CUDA never takes shortcuts)
    prompts = _prompts()
    steps = []
    for name in ("_decode", "_speculate"):
        real = getattr(engine, name)
        monkeypatch.setattr(engine, name,
                            lambda *args, real=real: steps.append(1) or real(*args))
    with counting_syncs(engine, monkeypatch) as (counter, transfers):
        outs = engine.generate(prompts, _params(kind, len(prompts)))
    assert counter.syncs == []
    assert len(transfers) == len(steps) > 0  # exactly one device -> host read per step
    assert all(len(o.token_ids) > 0 for o in outs)


def test_the_sync_counter_catches_a_host_read(tiny_checkpoint, monkeypatch):
    """The counter is not blind: a stage that reads a device value is caught."""
    engine = RolloutEngine(tiny_checkpoint[0], max_batch_size=2, max_seq_len=32)
    real = engine._decode_stage

    def leaky(*args):
        real(*args)
        int(engine.io.out[0, 0])
    monkeypatch.setattr(engine, "_decode_stage", leaky)
    with counting_syncs(engine, monkeypatch) as (counter, _):
        engine.generate(_prompts(2), SamplingParams(greedy=True, max_new_tokens=3))
    assert counter.syncs


COARSE = BucketPlan(batch_sizes=(2, 8), context_lens=(16, 48, 200))


@pytest.mark.parametrize("method", ["none", "eagle", "suffix"])
@pytest.mark.parametrize("kind", ["greedy", "mixed"])
def test_padding_to_buckets_changes_no_output(tiny_checkpoint, random_drafter, method, kind):
    """Exact sizes vs coarse buckets (padding rows up to 2 or 8, contexts up to 16/48/200):
    the same tokens, the same logprobs, for plain and speculative decoding."""
    path, _ = tiny_checkpoint
    spec = SpecConfig(method=method, depth=3, topk=2, tokens_to_verify=6)
    drafter = random_drafter if method == "eagle" else None
    prompts = _prompts(9)
    params = _params(kind, len(prompts))
    results = []
    for buckets in (None, COARSE):
        engine = RolloutEngine(path, max_batch_size=8, max_seq_len=64, spec=spec,
                               drafter=drafter, buckets=buckets)
        for _ in range(2 if method == "suffix" else 1):  # suffix: a second round can match
            outs = engine.generate(prompts, params)
            engine.advance_step()
        results.append(outs)
    exact, padded = results
    assert [c.token_ids for c in exact] == [c.token_ids for c in padded]
    for a, b in zip(exact, padded):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("method", ["none", "eagle"])
def test_slot_moves_keep_each_request_its_own_state(tiny_checkpoint, random_drafter, method):
    """Many requests through 3 slots: finishing requests leave holes that the highest slot
    fills (its KV, drafter state and sampling settings move). Every answer equals the same
    request rolled out alone."""
    path, _ = tiny_checkpoint
    spec = SpecConfig(method=method, depth=3, topk=2, tokens_to_verify=6)
    drafter = random_drafter if method == "eagle" else None
    prompts = _prompts(10)
    params = [SamplingParams(temperature=0.9, seed=i, max_new_tokens=3 + (7 * i) % 13,
                             ignore_eos=True) if i % 2 else
              SamplingParams(greedy=True, max_new_tokens=3 + (7 * i) % 13, ignore_eos=True)
              for i in range(len(prompts))]
    batched = RolloutEngine(path, max_batch_size=3, max_seq_len=64, spec=spec,
                            drafter=drafter).generate(prompts, params)
    alone = RolloutEngine(path, max_batch_size=1, max_seq_len=64, spec=spec, drafter=drafter)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        # request i of a call draws from seed + i: the lone call passes seed + i - 0
        single = alone.generate([prompt], p if p.seed is None else
                                SamplingParams(temperature=p.temperature, seed=p.seed + i,
                                               max_new_tokens=p.max_new_tokens,
                                               ignore_eos=True))[0]
        assert single.token_ids == batched[i].token_ids, i
