"""rollout.backend=vllm with rollout.tensor_parallel=2 on vLLM's CPU build (two CPU workers, a
core each, gloo between them; scripts/setup-vllm.sh's venv): the miniature's policy and EAGLE-3
drafter served over two ranks give the native engine's greedy completions and accept as much.
Slow (a vLLM start of its own, ~35 s)."""

from __future__ import annotations

import pytest

from fastdraft.engine import SamplingParams
from tests.backends.needs_vllm import needs_vllm
from tests.backends.test_vllm_rollout import serve

needs_vllm()
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm")]


def test_vllm_at_tensor_parallel_2_serves_what_the_native_engine_does(tmp_path):
    vllm, native, prompts = serve(tmp_path, tensor_parallel=2)
    try:
        assert vllm.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == 2
        greedy = SamplingParams(temperature=0.0, max_new_tokens=160)
        ours, theirs = native.generate(prompts, greedy), vllm.generate(prompts, greedy)
        same = sum(a.token_ids == b.token_ids for a, b in zip(ours, theirs))
        assert same >= len(prompts) - 2, f"{same} of {len(prompts)} identical"
        assert vllm.last_stats.accept_length == pytest.approx(native.last_stats.accept_length,
                                                              rel=0.1)
    finally:
        vllm.close()
