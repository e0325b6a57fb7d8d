"""A hybrid worker's weight sync, in this process: the actor's new weights land in the worker's
own engine straight from the gather (no host copy: `Tensor.cpu` is never called on the way),
bit for bit in the serving dtype; between rollout and update the engine gives back its KV cache
and keeps its weights."""

from __future__ import annotations

import pytest
import torch

from fastdraft import RolloutEngine, SamplingParams
from fastdraft.actor.sharding import full_tensor
from fastdraft.workers.hybrid import HEAD, HybridWorker
from tests.actor.test_actor import spec


def _worker(policy, release_kv: bool | None = None) -> HybridWorker:
    make_engine = lambda device: RolloutEngine(policy, device=device,  # noqa: E731
                                                dtype=torch.bfloat16, max_batch_size=2,
                                                max_seq_len=64)
    # FSDP2 over one rank (bf16 compute): the sync runs through the shards' all-gather
    return HybridWorker(make_engine, "cpu", 0, spec(policy, compute_dtype="bfloat16"),
                        rank=0, release_kv=release_kv)


@pytest.fixture
def worker(char_policy):
    return _worker(char_policy, release_kv=True)   # as on a GPU


def test_sync_moves_the_actors_weights_into_its_engine_without_a_host_copy(worker,
                                                                           monkeypatch):
    with torch.no_grad():   # an update: every master moves
        for param in worker.actor.model.parameters():
            param.add_(0.01)
    masters = {n: full_tensor(p.detach()).clone()
               for n, p in worker.actor.model.named_parameters()}

    # the head (embedding, lm_head) is copied out of the engine for the driver once loaded:
    # the only host copies
    head = {p.data_ptr() for n, p in worker.engine.model.named_parameters() if n in HEAD}
    real_cpu = torch.Tensor.cpu

    def no_host_copy(self, *args, **kwargs):
        if self.data_ptr() not in head:
            raise AssertionError("a weight went through the host")
        return real_cpu(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", no_host_copy)
    sync = worker.sync_weights(version=7)
    monkeypatch.undo()
    assert [n for n, _ in sync.head] == [n for n in HEAD if n in masters]
    served = dict(worker.engine.model.named_parameters())
    assert all(torch.equal(served[n], t.to(torch.bfloat16)) for n, t in masters.items())
    assert worker.engine.policy_version == 7
    # gathered a layer at a time in the compute dtype (bf16): the masters as the engine casts
    assert sync.devices == ("cpu",) and sync.nbytes == sum(t.numel() * 2
                                                            for t in masters.values())


def test_the_engine_gives_back_its_kv_cache_for_the_update_and_keeps_its_weights(worker):
    weights = {n: p.detach().clone() for n, p in worker.engine.model.named_parameters()}
    kv = worker.engine.runner.kv_cache
    released = worker.sleep()
    assert released == kv.numel() * kv.element_size()
    assert kv.untyped_storage().nbytes() == 0   # the cache's memory is back
    assert all(p.untyped_storage().nbytes() > 0 for p in worker.engine.model.parameters())
    worker.sync_weights(version=1)
    assert all(torch.equal(p, weights[n]) for n, p in worker.engine.model.named_parameters())


def test_the_sync_gathers_while_the_cache_is_given_back_and_generate_takes_it_back(
        worker, monkeypatch):
    """The order the sync phase's plan rests on (actor/memory_plan.py): every tensor is gathered
    and lands while the KV cache's memory is still free, so the device holds the gather or the
    cache, never both; the next generate allocates the cache again."""
    kv = worker.engine.runner.kv_cache
    worker.sleep()
    cache_at_each_gather = []
    gathered_for = worker.actor.gathered_for

    def watched(dtype):
        gathered = gathered_for(dtype)
        units = gathered.named_parameters

        def named():
            for name, tensor in units():
                cache_at_each_gather.append(kv.untyped_storage().nbytes())
                yield name, tensor
        gathered.named_parameters = named
        return gathered

    monkeypatch.setattr(worker.actor, "gathered_for", watched)
    worker.sync_weights(version=1)
    assert len(cache_at_each_gather) == len(list(worker.actor.model.parameters()))
    assert set(cache_at_each_gather) == {0}
    assert kv.untyped_storage().nbytes() == 0 and worker.engine.asleep   # through the sync
    worker.engine.generate([[5, 9, 2]], SamplingParams(max_new_tokens=4), use_tqdm=False)
    assert kv.untyped_storage().nbytes() == kv.numel() * kv.element_size()
    assert not worker.engine.asleep


def test_on_the_cpu_the_kv_cache_stays(char_policy):
    worker = _worker(char_policy)   # the default on a CPU device: one RAM, nothing to gain
    assert worker.sleep() == 0 and worker.engine.runner.kv_cache.untyped_storage().nbytes() > 0


def test_a_shared_drafter_is_loaded_only_when_its_checksum_holds(char_policy, char_drafter):
    """HybridWorker.share_drafter (one worker: no broadcast to make): what its trainer member
    published goes into its engine when the checksum is the published one; a mismatch (or a
    member with nothing that fits) is returned, and the engine keeps its drafter."""
    from fastdraft.config.engine import SpecConfig
    from fastdraft.drafter.checkpoint import trainable_named_tensors
    from fastdraft.utils.digest import tensor_digest
    make_engine = lambda device: RolloutEngine(  # noqa: E731
        char_policy, device=device, max_batch_size=2, max_seq_len=64, drafter=char_drafter,
        spec=SpecConfig(method="eagle", depth=2, topk=1, tokens_to_verify=2))
    worker = HybridWorker(make_engine, "cpu", 0, spec(char_policy), rank=0)
    served = trainable_named_tensors(worker.engine.model_drafter)
    before = [t.clone() for _, t in served]
    published = [t + 0.5 for _, t in served]   # what the member published: every tensor moved

    class Member:
        def last_published(self):
            return published

    worker.member = Member()
    layout = [(n, tuple(t.shape), t.dtype) for n, t in served]
    named = [(n, t) for (n, _), t in zip(served, published)]
    assert "checksum" in worker.share_drafter(layout, 3, "0" * 16, src=0)
    assert all(torch.equal(t, b) for (_, t), b in zip(served, before))   # nothing loaded
    worker.member = None   # nothing held: zeros went out, and their checksum fails
    assert worker.share_drafter(layout, 3, tensor_digest(named), src=0) is not None
    worker.member = Member()
    assert worker.share_drafter(layout, 3, tensor_digest(named), src=0) is None
    assert worker.engine.drafter_version == 3
    assert all(torch.equal(t, p) for (_, t), p in zip(served, published))
