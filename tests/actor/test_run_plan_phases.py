"""The run plan's peak per phase (rollout, update, sync) on a device: the CUDA contexts and NCCL
buffers in each, the graph pool where the engine keeps it, the sync's gather without the KV
cache on a hybrid GPU (the weights land before the cache returns: tests/workers/
test_weight_sync.py), and the figures as the dry run prints them and a run's metrics name
them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fastdraft.actor.memory_plan import ActorPlan, RunPlan, check_run_plan
from fastdraft.actor.phase_peaks import PhasePeaks
from fastdraft.actor.runtime_memory import (
    CUDA_CONTEXT_BYTES,
    NCCL_BUFFSIZE,
    NCCL_CHANNELS,
    NCCL_COMMUNICATOR_BYTES,
    RuntimeMemory,
)
from fastdraft.config.engine import SpecConfig
from fastdraft.config.sections import ActorConfig
from fastdraft.engine.envelope import Envelope
from fastdraft.engine.memory_plan import DrafterShape, plan_engine
from fastdraft.models import ModelConfig
from fastdraft.utils.device_memory import GB, Capacity

QWEN3_8B = ModelConfig.from_hf_dict(dict(
    model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
    num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    tie_word_embeddings=False))
SPEC = SpecConfig(method="eagle", depth=6, topk=4, tokens_to_verify=16)


def _plan(device: str = "cuda:0", hybrid: bool = True, tensor_parallel: int = 1,
          ranks: int = 8, slots: int = 32) -> RunPlan:
    engine = plan_engine(QWEN3_8B, envelope=Envelope.for_spec(2048, SPEC), num_slots=slots,
                         dtype=torch.bfloat16, device=device, spec=SPEC,
                         drafter=DrafterShape(kind="eagle3", draft_vocab=32768),
                         tensor_parallel=tensor_parallel)
    actor = ActorPlan.of(QWEN3_8B, ActorConfig(compute_dtype="bfloat16", num_ranks=ranks,
                                               micro_batch_tokens=2048), 0.0, 2048)
    return RunPlan(engine=engine, actor=actor, hybrid=hybrid)


def _kept(plan: RunPlan) -> int:
    """What a hybrid GPU holds through every phase."""
    engine = plan.engine
    return (engine.resident - engine.kv_cache - engine.graph_pool + plan.actor.state
            + plan.trainer + plan.runtime.nbytes)


def test_a_device_counts_each_process_s_cuda_context_and_each_nccl_communicator():
    assert NCCL_COMMUNICATOR_BYTES == NCCL_CHANNELS * NCCL_BUFFSIZE == 32 * 4 * 2**20
    on = RuntimeMemory.on_device
    # hybrid: the worker's context and the driver's; the workers' group, the replica's
    assert on(cuda=True, hybrid=True, device0=True, ranks=8) == RuntimeMemory(
        contexts=2, communicators=1)
    assert on(cuda=True, hybrid=True, device0=True, ranks=8, tensor_parallel=8) == \
        RuntimeMemory(contexts=2, communicators=2)
    assert on(cuda=True, hybrid=True, device0=True, ranks=1).communicators == 0   # no peer
    # other layouts: device 0 is the driver's own process; ranks 1.. have the driver's too
    assert on(cuda=True, hybrid=False, device0=True, ranks=1) == RuntimeMemory(contexts=1)
    assert on(cuda=True, hybrid=False, device0=False, ranks=4) == RuntimeMemory(
        contexts=2, communicators=1)
    assert on(cuda=False, hybrid=True, device0=True, ranks=8, tensor_parallel=2).nbytes == 0
    runtime = RuntimeMemory(contexts=2, communicators=2)
    assert runtime.nbytes == 2 * CUDA_CONTEXT_BYTES + 2 * NCCL_COMMUNICATOR_BYTES
    assert runtime.describe() == "2 CUDA contexts + 2 NCCL communicators 1.3 GB"


def test_every_phase_on_a_gpu_holds_the_contexts_and_the_nccl_buffers():
    plan, cpu = _plan(), _plan(device="cpu", hybrid=False)
    assert plan.runtime == RuntimeMemory(contexts=2, communicators=1)
    kept = _kept(plan)
    assert plan.phases.update == kept + plan.actor.update
    assert plan.phases.update - plan.runtime.nbytes == (
        plan.engine.resident - plan.engine.kv_cache - plan.engine.graph_pool
        + plan.actor.state + plan.actor.update)
    # a replica over 8 workers: its group is one more communicator on every device
    tp = _plan(tensor_parallel=8)
    assert tp.runtime.nbytes - plan.runtime.nbytes == NCCL_COMMUNICATOR_BYTES
    assert tp.phases.update - _kept(tp) == tp.actor.update
    assert cpu.runtime.nbytes == 0 and cpu.phases.update == (
        cpu.engine.resident + 8 * cpu.actor.state + cpu.actor.host + 8 * cpu.actor.update)


def test_the_graph_pool_counts_in_the_rollout_on_a_hybrid_gpu_and_in_every_phase_elsewhere():
    """A hybrid worker's sleep gives the graphs' pool back with the KV cache (engine/updates.py,
    engine/graphs.py release); an engine that never sleeps keeps it through the update and the
    push, where nothing else can allocate in it."""
    more = 3 * GB
    for hybrid in (True, False):
        plan = _plan(hybrid=hybrid)
        assert plan.engine.graph_pool > 0   # captured steps on CUDA
        bigger = dataclasses.replace(plan, engine=dataclasses.replace(
            plan.engine, graph_pool=plan.engine.graph_pool + more))
        grown = {phase: getattr(bigger.phases, phase) - getattr(plan.phases, phase)
                 for phase in ("rollout", "update", "sync")}
        expected = ({"rollout": more, "update": 0, "sync": 0} if hybrid
                    else {"rollout": more, "update": more, "sync": more})
        assert grown == expected, hybrid


def test_the_hybrid_sync_holds_the_gather_and_not_the_kv_cache():
    """The engine loads the gathered weights asleep and takes its cache back at the next
    generate, so the sync's peak is what every phase keeps plus the gather: the cache is not
    in it (were it woken first, the peak would be their sum, not the larger of the two)."""
    plan = _plan()
    engine, actor = plan.engine, plan.actor
    assert plan.phases.sync == _kept(plan) + actor.unit_push
    assert actor.unit_push == 2 * (actor.shape.root_params + 2 * actor.shape.layer_params)
    assert plan.phases.rollout - plan.phases.sync == (
        engine.kv_cache + engine.graph_pool + engine.step_scratch - actor.unit_push)
    # an engine serving in another dtype than the compute one: one fp32 parameter at a time
    fp16 = dataclasses.replace(plan, engine=dataclasses.replace(
        engine, shape=dataclasses.replace(engine.shape, dtype=torch.float16)))
    assert fp16.phases.sync == _kept(fp16) + actor.push
    # the online drafter's broadcast after the sync: fp32 tensors and the flat buffer
    member = dataclasses.replace(plan, trainer=GB)
    share = 2 * 4 * (engine.drafter_weights // 2)
    assert member.drafter_share == share
    assert member.phases.sync == _kept(member) + max(actor.unit_push, share)
    assert plan.drafter_share == 0 and dataclasses.replace(member, hybrid=False).drafter_share == 0


def test_the_plan_reports_each_phase_s_peak_and_refuses_at_the_largest():
    plan = _plan()
    phases = plan.phases
    assert isinstance(phases, PhasePeaks) and plan.device0_bytes == phases.peak
    assert phases.largest == "update" and phases.peak == phases.update > phases.rollout
    lines = plan.lines(Capacity.of("cuda:0", 80 * GB).usable)
    assert lines[1] == (f"  per phase: {phases.describe()} (the update counts); in each: "
                        "2 CUDA contexts + 1 NCCL communicator 1.2 GB")
    assert "given back for the update and the sync" in lines[0]
    report = plan.as_dict()
    assert report["phases"] == {"rollout": phases.rollout, "update": phases.update,
                                "sync": phases.sync}
    assert report["runtime"] == {"contexts": 2, "communicators": 1,
                                 "bytes": plan.runtime.nbytes}
    assert phases.as_metrics() == {f"memory/plan_{p}_gb": getattr(phases, p) / GB
                                   for p in ("rollout", "update", "sync")}
    crowded = _plan(slots=512)
    with pytest.raises(ValueError, match=r"at its rollout phase's peak \(rollout [\d.]+ GB \| "
                                         r"update [\d.]+ GB \| sync [\d.]+ GB\)"):
        check_run_plan(crowded, Capacity.of("cuda:0", 80 * GB).usable)
    assert PhasePeaks(rollout=1, update=3, sync=3).largest == "update"   # the first on a tie
