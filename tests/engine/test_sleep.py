"""An engine that sleeps (colocated placement: the actor updates on its device) gives back its KV
cache and, asked to, its weights, and wakes by itself exactly as it was: the same completions
as before it slept, a zeroed cache, the weights a push loads used as they are (a push wakes the
weights alone: the cache comes back at the next generate)."""

from __future__ import annotations

import pytest
import torch

from fastdraft.config.engine import SpecConfig
from fastdraft.engine import RolloutEngine, SamplingParams
from fastdraft.engine.sleep import Released

SPEC = SpecConfig(method="eagle", depth=3, topk=2, tokens_to_verify=6)


def _bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())


@pytest.fixture
def engine(tiny_checkpoint, random_drafter):
    path, _ = tiny_checkpoint
    return RolloutEngine(path, "cpu", max_batch_size=8, max_seq_len=96,
                         drafter=random_drafter, spec=SPEC)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_engine_woken_from_sleep_answers_as_before(engine, temperature):
    prompts = [[5, 9, 2, 14], [7, 7], [3, 4, 5, 6, 7, 8]]
    params = SamplingParams(temperature=temperature, max_new_tokens=20, seed=5)
    before = engine.generate(prompts, params, use_tqdm=False)
    weights = _bytes(engine.model.parameters())
    kv = engine.runner.kv_cache.untyped_storage().nbytes()
    assert engine.sleep(weights=True) == weights + kv
    assert engine.asleep and engine.runner.kv_cache.untyped_storage().nbytes() == 0
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
    after = engine.generate(prompts, params, use_tqdm=False)   # wakes by itself
    assert not engine.asleep
    assert [c.token_ids for c in after] == [c.token_ids for c in before]
    assert [c.logprobs for c in after] == [c.logprobs for c in before]


def test_on_the_cpu_sleep_gives_back_the_cache_and_keeps_the_weights(engine):
    kv = engine.runner.kv_cache.untyped_storage().nbytes()
    assert engine.sleep() == kv
    assert all(p.untyped_storage().nbytes() > 0 for p in engine.model.parameters())
    engine.wake()
    assert engine.runner.kv_cache.untyped_storage().nbytes() == kv


def test_a_push_wakes_the_weights_alone_and_the_cache_comes_back_zeroed(engine):
    """A push into a sleeping engine gets its weights back and loads them while the cache stays
    given back (the sync's gather has its memory: actor/memory_plan.py); the cache returns,
    zeroed, when a generate (here `wake`) needs it."""
    cache = engine.runner.kv_cache
    cache.fill_(float("nan"))   # stale bits a masked read would multiply by 0
    new = {n: torch.full_like(p, 0.01) for n, p in engine.model.named_parameters()}
    engine.sleep(weights=True)
    landed = []

    def pushed():
        for name, tensor in new.items():
            landed.append(cache.untyped_storage().nbytes())
            yield name, tensor

    assert engine.load_weights(pushed()) == 1
    assert set(landed) == {0} and engine.asleep and cache.untyped_storage().nbytes() == 0
    for name, param in engine.model.named_parameters():
        assert torch.equal(param, new[name]), name
    engine.wake()
    assert not engine.asleep and torch.count_nonzero(cache) == 0
    for name, param in engine.model.named_parameters():   # the push, not the host copy
        assert torch.equal(param, new[name]), name


def test_released_frees_a_storage_once_however_many_tensors_view_it():
    base = torch.arange(12.0)
    views = [base[:6], base[6:], base.view(3, 4)]
    released = Released()
    released.free(views, keep=True)
    assert released.nbytes == 48 and base.untyped_storage().nbytes() == 0
    released.free(views, keep=True)   # freed already: nothing more
    assert released.nbytes == 48
    released.restore()
    assert torch.equal(base, torch.arange(12.0)) and torch.equal(views[1], torch.arange(6.0, 12))
    assert not released


def test_released_restores_the_kept_storages_alone_when_asked():
    weights, cache = torch.arange(4.0), torch.ones(8)
    released = Released()
    released.free([weights], keep=True)
    released.free([cache], keep=False)
    released.restore(kept_only=True)
    assert torch.equal(weights, torch.arange(4.0)) and cache.untyped_storage().nbytes() == 0
    assert released and released.nbytes == 32
    released.restore()
    assert not released and torch.count_nonzero(cache) == 0
