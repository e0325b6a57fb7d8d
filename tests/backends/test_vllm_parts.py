"""The vLLM backend's parts that need no vLLM (they run in the main venv): its recipe checks,
the CPU kernel fix against a reference, the speculation counters' arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastdraft.backends.vllm_stats import spec_stats_of
from fastdraft.backends.vllm_worker import expand_any_dtype, serve_positions
from fastdraft.config import load_recipe

RECIPE = Path(__file__).parents[2] / "recipes" / "tiny-qwen3-eagle3.yaml"


@pytest.mark.usefixtures("local_ray")   # the trainer is a Ray actor
@pytest.mark.parametrize("captures", [True, False])
def test_auto_source_is_the_engines_capture_where_it_has_one_else_the_actor(
        char_policy, char_drafter, captures):
    from tests.trainer.online_helpers import eagle_engine
    from tests.trainer.test_drafter_resilience import _online
    assert load_recipe(RECIPE, ["rollout.backend=vllm"]).drafter.online.source == "auto"
    engine = eagle_engine(char_policy, char_drafter)
    engine.captures_hidden = captures   # False: what rollout.backend=vllm's engine says
    online = _online(engine)
    try:
        assert (online.on_hidden is not None) == captures   # the engine captures
        assert (online.actor_hidden_layers is not None) == (not captures)   # the actor feeds
    finally:
        online.close()


@pytest.mark.parametrize("overrides, message", [
    (["rollout.backend=sglang"], "rollout.backend must be one of native, vllm"),
    (["cluster.backend=ray"], "set cluster.backend=local"),
    (["drafter.online.source=engine"], "drafter.online.source=actor"),
    (["rollout.top_p=0.9"], "top_p=1 and top_k=-1"),
    (["rollout.spec.method=suffix"], "eagle or none"),
    (["drafter.kind=eagle1"], "drafter.kind=eagle3"),
    (["rollout.tuner.enabled=true"], "disable them"),
])
def test_a_recipe_vllm_cannot_serve_is_refused_with_what_to_change(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_recipe(RECIPE, ["rollout.backend=vllm", *overrides])


def test_native_recipes_are_unchanged_by_the_backend_key():
    cfg = load_recipe(RECIPE, ["drafter.online.source=engine", "cluster.backend=ray"])
    assert cfg.rollout.backend == "native"


def test_the_expand_kernel_writes_each_requests_value_to_its_tokens_in_the_outputs_dtype():
    temperature = torch.tensor([0.7, -1.0, 1.3])        # -1.0: greedy, read as 1
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    out = torch.full((8,), float("nan"))
    expand_any_dtype(out, temperature, cu, -1.0, 1.0)
    reference = torch.tensor([0.7, 0.7, 1.0, 1.0, 1.0, 1.3])   # [a, a, b, b, b, c]
    assert torch.equal(out[:6], reference)
    assert out[6:].isnan().all()   # past the tokens: untouched
    ids = torch.zeros(6, dtype=torch.int64)
    expand_any_dtype(ids, torch.tensor([4, 0, 9]), cu.long(), 0, 3)
    assert ids.tolist() == [4, 4, 3, 3, 3, 9]


def test_serve_positions_raises_a_config_to_the_served_length_and_never_lowers_it():
    class Config:
        max_position_embeddings = 256
    assert serve_positions(400, Config()).max_position_embeddings == 400
    assert serve_positions(128, Config()).max_position_embeddings == 256
    bare = object.__new__(type("Bare", (), {}))
    assert serve_positions(400, bare) is bare   # configs without the field pass through


def test_a_requests_spec_stats_come_from_its_verify_step_histogram():
    class Metrics:   # vLLM's RequestSpecDecodeMetrics, summary level
        histogram = (3, 2, 0, 4, 1)   # steps that accepted 0, 1, 2, 3, 4 of a chain of 4
        num_draft_tokens = 40
    stats = spec_stats_of(Metrics())
    assert (stats.num_verify_steps, stats.num_drafted) == (10, 40)
    assert stats.num_accepted == 2 + 12 + 4
    assert stats.accept_length == pytest.approx(1 + 18 / 10)   # vLLM's and fastdraft's definition
    assert stats.accepted_by_pos == [7, 5, 5, 1] and stats.drafted_by_pos == [10] * 4


def test_vllms_engine_arguments_tensor_parallel_graphs_and_memory_share():
    """The CPU build: eager, whole prompts; a GPU: CUDA graphs on and the share of each device
    the run's memory plan leaves vLLM (not vLLM's 0.9 beside an actor rank), refused when
    nothing worth serving is left."""
    from fastdraft.backends.vllm_args import MARGIN, vllm_engine_args
    from fastdraft.errors import FastdraftError
    cpu = vllm_engine_args(device="cpu", tensor_parallel=2, max_batch_size=16, max_seq_len=400)
    assert cpu["tensor_parallel_size"] == 2 and cpu["enforce_eager"]
    assert not cpu["enable_chunked_prefill"] and "gpu_memory_utilization" not in cpu
    gpu = vllm_engine_args(device="cuda", tensor_parallel=4, max_batch_size=64,
                           max_seq_len=4096, memory_reserve=30 * 10**9, device_bytes=80 * 10**9)
    assert gpu["tensor_parallel_size"] == 4 and gpu["enforce_eager"] is False
    assert gpu["gpu_memory_utilization"] == pytest.approx(50 / 80 - MARGIN, abs=1e-3)
    assert gpu["max_num_seqs"] == 64 and "enable_chunked_prefill" not in gpu
    with pytest.raises(FastdraftError, match="leaves vLLM"):
        vllm_engine_args(device="cuda", tensor_parallel=1, max_batch_size=8, max_seq_len=512,
                         memory_reserve=70 * 10**9, device_bytes=80 * 10**9)


def test_a_vllm_run_hands_vllm_the_recipes_tensor_parallel_and_the_plans_reserve(
        monkeypatch, tmp_path):
    from fastdraft import backends
    from fastdraft.backends import vllm_rollout
    seen = {}
    monkeypatch.setattr(vllm_rollout, "VllmRollout",
                        lambda host, *a, **kw: seen.update(kw) or "vllm")
    cfg = load_recipe(RECIPE, ["rollout.backend=vllm", "rollout.tensor_parallel=2",
                               "drafter.online.source=actor"])
    assert backends.build_rollout(cfg, lambda *a, **k: None, tmp_path, None, tmp_path, 400,
                                  memory_reserve=123) == "vllm"
    assert seen["tensor_parallel"] == 2 and seen["memory_reserve"] == 123


def test_vllms_cpu_workers_get_cores_of_their_own():
    from fastdraft.backends.vllm_args import cpu_thread_binding
    from fastdraft.errors import FastdraftError
    assert cpu_thread_binding([1, 0], 2) == "0|1"
    assert cpu_thread_binding(list(range(8)), 2) == "0,1,2,3|4,5,6,7"
    with pytest.raises(FastdraftError, match=r"lower rollout\.tensor_parallel"):
        cpu_thread_binding([0], 2)
