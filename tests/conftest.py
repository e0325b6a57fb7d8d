"""Shared fixtures: tiny random HF checkpoints (no downloads), one per session."""

from __future__ import annotations

import os

import pytest
import torch
import transformers


def pytest_configure(config) -> None:
    """Under pytest-xdist (scripts/test.sh: two workers on two cores) each worker computes on
    one thread: tiny models gain little from a second intra-op thread, and two workers with two
    threads each would thrash."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray cluster of 2 CPUs for a test module's Ray actors (trainers, ranks); a run
    started inside it joins it and leaves it up."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")   # tests connect to loopback addresses only
    _FIXTURE_RAY.append(True)
    yield
    _FIXTURE_RAY.clear()
    ray.shutdown()


_FIXTURE_RAY: list[bool] = []   # set while local_ray's cluster is up (module-scoped)


@pytest.fixture(autouse=True)
def _no_ray_left(request):
    """A test that left Ray up (a Run it never finished started one) has it shut down: the next
    test's run would join it and find its CPUs held by the actors left in it."""
    yield
    if _FIXTURE_RAY:   # a module's own cluster, shut down at the module's end
        return
    import sys
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        from fastdraft.actor.sharding import leave_ranks
        from fastdraft.cluster.ray_cluster import shutdown
        leave_ranks()   # an actor left open: its group goes before its follower ranks do
        shutdown()


def make_tiny_checkpoint(path, model_type: str = "qwen2", vocab_size: int = 64, seed: int = 0,
                         **overrides) -> transformers.PreTrainedModel:
    configs = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig,
               "qwen3": transformers.Qwen3Config}
    kwargs = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=1, bos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    cfg = configs[model_type](**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # sharper logits than the 0.02 init, so outputs vary with the prompt
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    model.eval().save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2")
    hf = make_tiny_checkpoint(path)
    return path, hf


@pytest.fixture(scope="session")
def random_drafter(tiny_checkpoint, tmp_path_factory):
    """An untrained EAGLE-1 drafter for the tiny checkpoint: poor drafts exercise every
    reject path, and losslessness must hold regardless."""
    from fastdraft.drafter import build_drafter, save_drafter
    from fastdraft.models import load_model
    path, _ = tiny_checkpoint
    policy = load_model(path)
    torch.manual_seed(0)
    drafter = build_drafter("eagle1", policy.config, 256).attach(policy)
    out = tmp_path_factory.mktemp("drafter")
    save_drafter(drafter, out)
    return out


@pytest.fixture(scope="session")
def char_policy(tmp_path_factory):
    """A tiny untrained policy with the bootstrap's char tokenizer: enough for the RL loop."""
    from fastdraft.bootstrap.tokenizer import (
        DEFAULT_ALPHABET,
        build_char_tokenizer,
        vocab_size_for,
    )
    path = tmp_path_factory.mktemp("char-policy")
    make_tiny_checkpoint(path, vocab_size=vocab_size_for(DEFAULT_ALPHABET), eos_token_id=1,
                         pad_token_id=0, max_position_embeddings=512)
    build_char_tokenizer(path)
    return path


def _untrained_drafter(kind: str, policy_dir, out, draft_vocab: int):
    """An untrained `kind` drafter for the policy at policy_dir, saved in out."""
    from fastdraft.drafter import build_drafter, save_drafter
    from fastdraft.models import load_model
    policy = load_model(policy_dir)
    torch.manual_seed(0)
    save_drafter(build_drafter(kind, policy.config, draft_vocab).attach(policy), out)
    return out


@pytest.fixture(scope="session")
def char_drafter(char_policy, tmp_path_factory):
    """An untrained EAGLE-1 drafter for char_policy."""
    return _untrained_drafter("eagle1", char_policy, tmp_path_factory.mktemp("char-drafter"), 512)


@pytest.fixture(scope="session")
def char_eagle3(char_policy, tmp_path_factory):
    """An untrained EAGLE-3 drafter for char_policy (aux layers of its 2 layers: (1, 1, 0))."""
    return _untrained_drafter("eagle3", char_policy, tmp_path_factory.mktemp("char-eagle3"), 512)


@pytest.fixture(scope="session")
def policy_and_drafter(tmp_path_factory):
    """The bootstrap policy (cached) and an untrained EAGLE-1 drafter for it: what the CLI runs
    of the signal and fault tests serve."""
    from fastdraft.bootstrap.run import run_bootstrap
    policy_dir = run_bootstrap().policy_dir
    return policy_dir, _untrained_drafter("eagle1", policy_dir,
                                          tmp_path_factory.mktemp("stop-drafter"), 256)
