"""RolloutPool on a local Ray cluster: placement never changes a completion (1 or 2 workers,
greedy and sampled, speculative), nor does tail consolidation (a worker's tail moved into a
generating worker), pushed weights reach every worker, and a worker killed mid-rollout has its
share (and the tails it took) re-run to the same completions and is replaced."""

from __future__ import annotations

import os
import signal
import threading
import time
from functools import partial

import pytest
import torch

from fastdraft.config.engine import SpecConfig
from fastdraft.config.sections import ClusterConfig
from fastdraft.engine import RolloutEngine, SamplingParams

ray = pytest.importorskip("ray")

SPEC = SpecConfig(method="eagle", depth=3, topk=2, tokens_to_verify=6)
GROUP = 4
pytestmark = pytest.mark.xdist_group("ray")   # one Ray cluster at a time


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")   # tests connect to loopback addresses only
    yield
    ray.shutdown()


def _factory(path, drafter):
    return partial(RolloutEngine, path, max_batch_size=32, max_seq_len=160, drafter=drafter,
                   spec=SPEC)


def _pool(path, drafter, workers: int, dispatch: str = "balance", **cluster):
    from fastdraft.workers.pool import RolloutPool
    host = RolloutEngine(path, "cpu", max_batch_size=1, max_seq_len=160, drafter=drafter,
                         spec=SPEC)
    cfg = ClusterConfig(backend="ray", rollout_workers=workers, dispatch=dispatch,
                        max_worker_restarts=2, **cluster)
    return RolloutPool(cfg, _factory(path, drafter), host, "cpu", GROUP)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 60, (int(torch.randint(2, 9, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n // GROUP) for _ in range(GROUP)]


def _same(a, b) -> None:
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_placement_never_changes_a_completion(local_ray, tiny_checkpoint, random_drafter,
                                              temperature):
    path, _ = tiny_checkpoint
    prompts = _prompts(24)
    params = SamplingParams(temperature=temperature, max_new_tokens=40, seed=7)
    local = _factory(path, random_drafter)("cpu").generate(prompts, params, use_tqdm=False)
    for workers, dispatch in ((1, "balance"), (2, "balance"), (2, "concentrate")):
        pool = _pool(path, random_drafter, workers, dispatch)
        try:
            got = pool.generate(prompts, params)
            _same(got, local)
            # A second rollout: dispatch now predicts costs from the first one's lengths.
            _same(pool.generate(prompts, params), local)
            assert [c.index for c in got] == list(range(len(prompts)))
            assert {s.worker for s in pool.last_spans} == {f"rollout{k}" for k in range(workers)}
        finally:
            pool.close()


@pytest.mark.parametrize("temperature,below,stops", [
    (0.0, 13, ()), (1.0, 4, tuple(range(3, 9)))])
def test_tail_consolidation_never_changes_a_completion(local_ray, tiny_checkpoint,
                                                       random_drafter, temperature, below,
                                                       stops):
    """A worker left with fewer than `below` requests while the other generates hands them
    over and the completions are the local engine's, token for token; so are the drafter
    samples, which the receiver captures whole. Greedy, below=13 > a worker's share of 12:
    everything after its first step, queued requests too (greedy answers here all run to the
    cap); sampled, 4 with stop tokens: a long-tailed length mix, the real case."""
    from fastdraft.trainer.collector import SampleCollector
    path, _ = tiny_checkpoint
    prompts = _prompts(24)
    params = SamplingParams(temperature=temperature, max_new_tokens=40, seed=7,
                            stop_token_ids=stops)
    local = SampleCollector(_Samples())
    local.start_step(0)
    want = _factory(path, random_drafter)("cpu").generate(
        prompts, params, use_tqdm=False, on_hidden=local, on_finish=local.on_finish)
    pool = _pool(path, random_drafter, 2, "concentrate", consolidate_below=below)
    moved = 0
    try:
        for _ in range(2):   # the second: dispatch predicts from the first's lengths
            remote = SampleCollector(_Samples())
            remote.start_step(0)
            _same(pool.generate(prompts, params, on_hidden=remote), want)
            moved += pool.last_migrated
            assert sorted(s.request_index for s in remote.buffer) == sorted(
                s.request_index for s in local.buffer)
            mine = sorted(remote.buffer, key=lambda s: s.request_index)
            for a, b in zip(mine, sorted(local.buffer, key=lambda s: s.request_index)):
                assert torch.equal(a.token_ids, b.token_ids)
                assert torch.equal(a.positions, b.positions)
    finally:
        pool.close()
    assert moved > 0, "no tail moved: the test exercised nothing"


def test_pushed_weights_reach_every_worker(local_ray, tiny_checkpoint, random_drafter):
    from fastdraft.models.loading import iter_safetensors
    path, _ = tiny_checkpoint
    torch.manual_seed(3)
    changed = [(n, t + 0.05 * torch.randn_like(t)) for n, t in iter_safetensors(path)]
    local = _factory(path, random_drafter)("cpu")
    local.load_weights(changed)
    prompts, params = _prompts(16), SamplingParams(temperature=1.0, max_new_tokens=30, seed=3)
    pool = _pool(path, random_drafter, 2, push_bucket_mb=0.02)   # 20 KB: many buckets
    try:
        before = pool.generate(prompts, params)
        assert pool.load_weights(iter(changed)) == 1 and pool.policy_version == 1
        assert len(pool._weights) > 3   # streamed in buckets
        after = pool.generate(prompts, params)
        _same(after, local.generate(prompts, params, use_tqdm=False))
        assert [c.token_ids for c in after] != [c.token_ids for c in before]
        assert all(c.policy_version == 1 for c in after)
        assert pool.last_push_s > 0
    finally:
        pool.close()


@pytest.mark.parametrize("below", [0, 17])
def test_a_worker_killed_mid_rollout_is_rerun_and_replaced(local_ray, tiny_checkpoint,
                                                           random_drafter, below):
    """below=17: 9 groups split 5/4, so only the worker with 16 requests (< 17) hands its share
    to the other after one step (equal shares could both yield at once and each finish its
    own), and that receiver is killed holding requests that were not dispatched to it."""
    path, _ = tiny_checkpoint
    prompts = _prompts(36 if below else 64)
    params = SamplingParams(temperature=1.0, max_new_tokens=120, seed=11, ignore_eos=True)
    pool = _pool(path, random_drafter, 2, consolidate_below=below)
    try:
        reference = pool.generate(prompts, params)
        pids = pool.worker_pids()
        # below: the receiver, the worker whose running call holds both shares; else the first
        # worker seen holding requests (a timer could fire after a fast rollout had ended)
        holds = (lambda owned: len(owned) > 20) if below else (lambda owned: len(owned) > 0)
        threading.Thread(target=_kill_when, args=(pool, pids, holds)).start()
        got = pool.generate(prompts, params)
        _same(got, reference)
        assert pool.restarts == 1 and pool.reruns > (20 if below else 0)
        new = pool.worker_pids()
        assert len(set(new) - set(pids)) == 1 and len(new) == 2
        _same(pool.generate(prompts, params), reference)   # the replacement serves too
    finally:
        pool.close()


def _kill_when(pool, pids: list[int], holds, timeout_s: float = 60.0) -> None:
    """SIGKILLs the first worker whose running call's requests satisfy `holds` (the driver
    thread updates pool.calls; this one only reads it)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        calls = pool.calls
        for c in list(calls.pending.values()) if calls is not None else []:
            if holds(c.indices):
                os.kill(pids[c.worker], signal.SIGKILL)
                return
        time.sleep(0.005)


class _Samples(list):
    def add(self, sample) -> None:
        self.append(sample)


class _Batches(list):
    def add_many(self, samples) -> None:
        self.append(samples)


def test_workers_turn_hidden_states_into_the_samples_a_local_engine_gives(
        local_ray, tiny_checkpoint, random_drafter):
    """The online drafter's data: each worker builds its requests' samples (under their index
    in the whole rollout, the step's number) and the collector's buffer gets the same samples
    a local engine's collector makes."""
    from fastdraft.trainer.collector import SampleCollector
    path, _ = tiny_checkpoint
    prompts, params = _prompts(16), SamplingParams(temperature=1.0, max_new_tokens=30, seed=5)
    local = SampleCollector(_Samples())
    local.start_step(4)
    engine = _factory(path, random_drafter)("cpu")
    engine.generate(prompts, params, on_hidden=local, on_finish=local.on_finish,
                    use_tqdm=False)
    remote = SampleCollector(_Batches())
    remote.start_step(4)
    pool = _pool(path, random_drafter, 2, "concentrate")
    try:
        pool.generate(prompts, params, on_hidden=remote)
        # A buffer that takes batches (the online drafter's) gets each worker's samples as a
        # reference: they go from the worker to the trainer, never opened by the driver.
        assert remote.buffer and all(isinstance(r, ray.ObjectRef) for r in remote.buffer)
        got = [s for ref in remote.buffer for s in ray.get(ref)]
    finally:
        pool.close()
    assert remote.num_added == local.num_added == len(prompts)
    mine = sorted(got, key=lambda s: s.request_index)
    theirs = sorted(local.buffer, key=lambda s: s.request_index)
    assert [s.request_index for s in mine] == [s.request_index for s in theirs]
    for a, b in zip(mine, theirs):
        assert a.rl_step == 4 and torch.equal(a.token_ids, b.token_ids)
        assert torch.equal(a.positions, b.positions) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.allclose(a.hidden.float(), b.hidden.float(), atol=2e-2)
