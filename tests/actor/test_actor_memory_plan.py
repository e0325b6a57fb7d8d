"""The actor's memory plan (a 7B shape over 8 ranks, by hand), its activation estimate against
the tensors autograd really saves, and the run plan's refusal naming what to change."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import replace

import pytest
import torch

from fastdraft.actor.memory_plan import ActorPlan, RunPlan, check_run_plan
from fastdraft.actor.runtime_memory import (
    CUDA_CONTEXT_BYTES,
    NCCL_COMMUNICATOR_BYTES,
    RuntimeMemory,
)
from fastdraft.algo.logprobs import logprobs_of, next_token_logits
from fastdraft.bench.real_shapes import shape_config
from fastdraft.config.engine import SpecConfig
from fastdraft.config.sections import ActorConfig
from fastdraft.engine.envelope import Envelope
from fastdraft.engine.memory_plan import DrafterShape, plan_engine
from fastdraft.models import CausalLM, ModelConfig
from fastdraft.utils.device_memory import GB, Capacity

BF16_8_RANKS = ActorConfig(compute_dtype="bfloat16", num_ranks=8, micro_batch_tokens=2048)


def test_actor_plan_of_a_7b_shape_over_8_ranks():
    cfg = shape_config("qwen2.5-7b")   # h 3584, I 18944, 28 layers, 28 / 4 heads, V 152064
    plan = ActorPlan.of(cfg, BF16_8_RANKS, kl_coef=0.001, max_seq_len=2048)
    h, inter, vocab, q, kv = 3584, 18944, 152064, 28 * 128, 4 * 128
    layer = h * (q + 2 * kv) + (q + 2 * kv) + q * h + 3 * h * inter + 2 * h   # qkv bias
    root = 2 * vocab * h + h                       # embedding, lm_head (untied), final norm
    params = 28 * layer + root
    assert params == 7_615_616_512
    shard = -(-params // 8)
    assert plan.masters == plan.grads == 4 * shard   # fp32, 1/8 each
    assert plan.reference == 2 * shard               # frozen: bf16, 1/8
    assert plan.optimizer == 8 * shard               # two fp32 moments
    assert plan.state == 14 * shard and 7.6e9 < plan.state < 7.7e9 * 2
    assert plan.host == 12 * params                                     # rank 0's snapshot
    assert plan.gathered == 2 * (2 * root + 2 * layer) + 4 * layer
    per_token_layer = 2 * 8 * h + 2 * (2 * q + 2 * kv) + 4 * 28 + 8 * inter
    # + the final norm and the chunked head's saved answer states (bf16) and lse / indices
    assert plan.activations == 2048 * (28 * per_token_layer + 10 * h + 28)
    chunk = 2048 * vocab   # logits_chunk_tokens 4096 > the micro-batch's 2048 tokens
    assert plan.logits == chunk * 4 + max(chunk * 4, 7 * 64 * 2**20)   # fp32 / T, lse or gate
    reference_forward = 2 * (root + 2 * layer) + chunk * 8
    assert plan.logits_backward == max(chunk * (4 + 2), reference_forward)   # fp32, its bf16
    assert plan.push == 4 * vocab * h                                    # the largest parameter
    assert plan.unit_push == 2 * (root + 2 * layer)    # a hybrid sync: root and two layers, bf16
    assert plan.sync_push(torch.bfloat16) == plan.unit_push
    assert plan.sync_push(torch.float16) == plan.push   # cast: one fp32 parameter at a time
    assert plan.update == plan.grads + plan.gathered + plan.activations \
        + max(plan.logits, plan.logits_backward)
    assert plan.per_rank_bytes == plan.state + plan.update
    # No KL: no reference; more ranks: smaller shards, the same activations.
    no_kl = ActorPlan.of(cfg, BF16_8_RANKS, kl_coef=0.0, max_seq_len=2048)
    assert no_kl.reference == 0 and no_kl.state == plan.state - plan.reference
    assert plan.with_ranks(16).masters == 4 * -(-params // 16)
    assert plan.with_ranks(16).activations == plan.activations


def test_a_micro_batch_holds_at_least_one_whole_sequence():
    cfg = shape_config("qwen2.5-7b")
    short = ActorPlan.of(cfg, BF16_8_RANKS, 0.0, max_seq_len=3072)
    assert short.shape.tokens == 3072   # algo/sequences.py: a longer row gets its own micro-batch
    assert short.activations > ActorPlan.of(cfg, BF16_8_RANKS, 0.0, 2048).activations


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "bfloat16"), (torch.float32, "float32")])
@pytest.mark.parametrize("model_type", ["qwen3", "qwen2"])
def test_activation_estimate_is_what_autograd_saves(dtype, name, model_type):
    """The actor's forward (next_token_logits + logprobs_of), its saved tensors counted by
    storage, against activations + the fp32 logits the loss keeps."""
    hf = dict(model_type=model_type, vocab_size=512, hidden_size=128, intermediate_size=384,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              tie_word_embeddings=False, **({"head_dim": 64} if model_type == "qwen3" else {}))
    cfg = ModelConfig.from_hf_dict(hf)
    model = CausalLM(cfg, 256).to(dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, 512, (4, 65))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs_of(next_token_logits(model, ids), ids, temperature=1.0).sum().backward()
    actor = ActorConfig(compute_dtype=name, num_ranks=2, micro_batch_tokens=4 * 65)
    plan = ActorPlan.of(cfg, actor, 0.0)
    expected = plan.activations + 4 * 64 * 512 * 4   # + the fp32 logits / T
    assert sum(saved.values()) == pytest.approx(expected, rel=0.03)


QWEN3_8B = ModelConfig.from_hf_dict(dict(
    model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
    num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    tie_word_embeddings=False))
SPEC = SpecConfig(method="eagle", depth=6, topk=4, tokens_to_verify=16)


def _run_plan(slots: int, max_seq_len: int, tokens: int, device: str = "cuda:0") -> RunPlan:
    engine = plan_engine(QWEN3_8B, envelope=Envelope.for_spec(max_seq_len, SPEC),
                         num_slots=slots, dtype=torch.bfloat16, device=device, spec=SPEC,
                         drafter=DrafterShape(kind="eagle3", draft_vocab=32768))
    actor = ActorPlan.of(QWEN3_8B, ActorConfig(compute_dtype="bfloat16", num_ranks=8,
                                               micro_batch_tokens=tokens), 0.0, max_seq_len)
    return RunPlan(engine=engine, actor=actor)


def test_run_plan_puts_engine_and_rank_0_on_one_device():
    plan = _run_plan(32, 2048, 2048)
    engine, actor = plan.engine, plan.actor
    # one process (the driver's context) in the 8 ranks' NCCL group
    assert plan.runtime == RuntimeMemory(contexts=1, communicators=1)
    # rollout (engine steps), update and push (actor) never overlap: the largest counts
    assert plan.device0_bytes == (engine.resident + actor.state + plan.runtime.nbytes
                                  + max(engine.step_scratch, actor.transient))
    # the engine's check measures free bytes its own process's context is already out of
    assert plan.engine_reserve + engine.total + CUDA_CONTEXT_BYTES == plan.device0_bytes
    # here the update's peak is the larger: the engine's prefill scratch is reused by it
    assert actor.transient > engine.step_scratch and plan.phases.largest == "update"
    assert plan.device0_bytes == engine.resident + actor.per_rank_bytes + plan.runtime.nbytes
    # ranks 1..: their own process's context, the driver's, the ranks' communicator
    assert plan.other_rank_bytes == (actor.per_rank_bytes + 2 * CUDA_CONTEXT_BYTES
                                     + NCCL_COMMUNICATOR_BYTES)


def test_run_plan_refusal_names_settings_that_fit():
    usable = Capacity.of("cuda:0", 80 * GB).usable
    fitting = _run_plan(32, 2048, 2048)
    check_run_plan(fitting, usable)
    crowded = _run_plan(256, 2048, 2048)
    with pytest.raises(ValueError) as err:
        check_run_plan(crowded, usable)
    message = str(err.value)
    assert "device 0 (the engine and the actor's rank 0)" in message
    slots = int(re.search(r"rollout\.max_batch_size to <= (\d+)", message).group(1))
    assert crowded.replan(slots=slots).fits(usable)
    assert not crowded.replan(slots=slots + 1).fits(usable)
    # The old 8B recipe: no single setting is enough, two together are.
    old = _run_plan(256, 3072, 16384)
    with pytest.raises(ValueError, match=r"Together: lower actor\.micro_batch_tokens to 3072 "
                                         r"\(one longest sequence\) and rollout\.max_batch_size "
                                         r"to <= (\d+)") as err:
        check_run_plan(old, usable)
    slots = int(re.search(r"max_batch_size to <= (\d+)", str(err.value)).group(1))
    assert old.replan(tokens=3072, slots=slots).fits(usable)


def test_ranks_that_do_not_fit_name_num_ranks():
    plan = _run_plan(8, 2048, 2048)
    actor = plan.actor.with_ranks(2)   # 16 x 8.19B / 2 = 65.5 GB of state a rank
    with pytest.raises(ValueError, match=r"each other rank's device.*raise actor\.num_ranks to "
                                         r">= \d+"):
        check_run_plan(dataclasses.replace(plan, actor=actor),
                       Capacity.of("cuda:0", 80 * GB).usable)


def test_hybrid_plan_gives_every_device_a_replica_and_the_kv_cache_back_for_the_update():
    plan = dataclasses.replace(_run_plan(32, 2048, 2048), hybrid=True)
    engine, actor = plan.engine, plan.actor
    # the KV cache and graph pool never add up with the update's transient nor the sync's
    # gather: they are given back first and return at the next rollout
    kept = (engine.resident - engine.kv_cache - engine.graph_pool + actor.state
            + plan.runtime.nbytes)
    assert plan.device0_bytes == kept + max(
        engine.kv_cache + engine.graph_pool + engine.step_scratch, actor.update,
        actor.unit_push)
    one_engine = dataclasses.replace(plan, hybrid=False)
    assert plan.device0_bytes < one_engine.device0_bytes
    assert plan.fits(Capacity.of("cuda:0", 80 * GB).usable)
    crowded = dataclasses.replace(_run_plan(512, 3072, 3072), hybrid=True)
    with pytest.raises(ValueError, match=r"on each device \(an engine replica and an actor "
                                         r"rank\).*rollout\.max_batch_size to <= \d+"):
        check_run_plan(crowded, Capacity.of("cuda:0", 80 * GB).usable)
    # the drafter trainer member on each device counts: a plan that fits without it may not
    usable = Capacity.of("cuda:0", 80 * GB).usable
    room = usable - plan.device0_bytes
    check_run_plan(dataclasses.replace(plan, trainer=room), usable)
    with pytest.raises(ValueError, match=r"on each device"):
        check_run_plan(dataclasses.replace(plan, trainer=room + 1), usable)
    cpu = dataclasses.replace(_run_plan(4, 256, 256, device="cpu"), hybrid=True)
    # 8 workers in one RAM, each keeping its KV cache (nothing to give back to on a CPU); the
    # checkpoint is each worker's shard written in place: no snapshot on rank 0's host; no CUDA
    # context, no NCCL buffers (gloo)
    per_worker = (cpu.engine.resident + cpu.actor.state
                  + max(cpu.engine.step_scratch, cpu.actor.update, cpu.actor.unit_push))
    assert cpu.runtime.nbytes == 0 and cpu.device0_bytes == 8 * per_worker


def test_cpu_run_plan_shares_one_ram():
    plan = _run_plan(4, 256, 256, device="cpu")
    ranks = plan.actor.shape.num_ranks
    assert plan.on_cpu
    assert plan.device0_bytes == (plan.engine.resident + ranks * plan.actor.state
                                  + plan.actor.host
                                  + max(plan.engine.step_scratch, ranks * plan.actor.transient))


def test_activation_checkpointing_keeps_one_layer_input_a_token_per_layer():
    cfg = shape_config("qwen2.5-7b")
    full = ActorPlan.of(cfg, BF16_8_RANKS, kl_coef=0.0, max_seq_len=2048)
    kept = ActorPlan.of(cfg, replace(BF16_8_RANKS, activation_checkpointing=True), kl_coef=0.0,
                        max_seq_len=2048)
    per_token_layer = full.activations // 2048 // 28   # (roughly: the final norm aside)
    assert kept.activations == 2048 * (28 * 2 * 3584 + (2 * 8 * 3584 + 8 * 18944
                                       + 2 * (2 * 28 * 128 + 2 * 4 * 128) + 4 * 28)
                                       + 10 * 3584 + 28)
    assert kept.activations * 10 < full.activations and per_token_layer > 0


_PEAK = """
import torch
from fastdraft.actor.memory_plan import ActorPlan
from fastdraft.algo.answer_scores import AnswerScores, ScoreSpec
from fastdraft.algo.objective import Algorithm
from fastdraft.algo.sequences import build_batch
from fastdraft.config.sections import ActorConfig, AlgorithmConfig
from fastdraft.models import CausalLM, ModelConfig
from fastdraft.utils.device_memory import process_peak_bytes
torch.set_num_threads(1)
cfg = ModelConfig.from_hf_dict(dict(model_type="qwen3", vocab_size=32000, hidden_size=64,
    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, tie_word_embeddings=False))
model = CausalLM(cfg, 3100)
answer = torch.randint(3, 32000, (3000,), generator=torch.Generator().manual_seed(1)).tolist()
batch = build_batch([[5] * 8], [answer], [[-2.0] * 3000], [1.0])
objective = Algorithm(AlgorithmConfig(), 1.0).objective(batch, None)
before = process_peak_bytes()
spec = ScoreSpec(temperature=1.0, chunk_tokens=1024, top_p=0.9)
logprobs, _, _ = AnswerScores(batch, spec).forward(model, stats=True)
objective(logprobs, batch)[0].backward()
peak = process_peak_bytes() - before
plan = ActorPlan.of(cfg, ActorConfig(micro_batch_tokens=3008, logits_chunk_tokens=1024), 0.0)
print(peak, plan.grads + plan.activations + max(plan.logits, plan.logits_backward))
"""


def test_the_update_plan_is_within_a_fifth_of_the_measured_peak():
    """One micro-batch of a 3000-token answer, a 32k vocabulary, logits in chunks of 1024 and
    the gate's statistics (top_p 0.9): the process's peak resident memory over the update
    against the plan's gradients + activations + the larger of the forward's and backward's
    logits (the peak of a fresh process: its allocator returns large blocks to the system)."""
    import os
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _PEAK], capture_output=True, text=True,
                         check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    peak, planned = map(int, out.stdout.split())
    print(f"measured peak {peak / 2**20:.0f} MB, planned {planned / 2**20:.0f} MB")
    assert 0.8 * peak <= planned <= 1.2 * peak
