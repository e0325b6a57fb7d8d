"""The actor's memory plan per rank, and the run's: the engine and the actor's rank 0 share
model.device, ranks 1.. have a device each; checked before anything is loaded.

Per rank (ActorPlan), for FSDP2 over num_ranks ranks (actor/sharding.py):
- state, for the whole run: fp32 master weights and AdamW's two fp32 moments, 1/num_ranks each;
  with kl_coef > 0 the frozen reference's shard, stored in the compute dtype;
- the update's transient: fp32 gradient shards; the all-gathered parameters in compute dtype
  (the root unit, embedding + norm + lm_head, stays gathered through forward and backward
  with its unsharded gradient; a decoder layer and the prefetched next one; one layer's fp32
  gradient for the reduce-scatter); the activations autograd saves over one micro-batch
  (per layer and token, as measured in the tests: the norms' fp32 input and normed output,
  QK-norm's, q/k/v and the attention output, the MLP's gate, up, their SiLU and product; the
  answer positions' final hidden states and log-sum-exps the chunked head keeps); the logits
  of one chunk of answer tokens (actor.logits_chunk_tokens, algo/answer_scores.py), never a
  micro-batch's: in the forward a chunk's logits in compute dtype and fp32 / T, and the gate's
  statistics' temporaries (sub-chunks of algo/token_stats.CHUNK_BYTES); then either the
  backward's (a chunk's logits again, fp32 / T, turned into their gradient in place, and its
  compute-dtype copy; the head's gradient is the root's, counted in `gathered`) or the
  reference's forward (its gathered root and
  layers, a chunk's logits), whichever is larger: the reference runs before the backward;
- the weight push (and a checkpoint's gather): every rank all-gathers one full fp32 parameter
  at a time (the largest: the embedding); gradients are freed by then. A hybrid worker's sync
  (ActorRank.gathered_for) gathers one FSDP unit at a time in the compute dtype instead when
  the engine serves in it or it is fp32: the root unit and two layers (the one landing in the
  engine, the next one's gather running beside it).
A micro-batch holds micro_batch_tokens tokens (real ones when packed, else rows x the longest),
or one whole row when a row is longer (algo/sequences.py): tokens = max(micro_batch_tokens,
the longest sequence).
Host (rank 0): a checkpoint gathers the full fp32 masters and both AdamW moments there (12
bytes a parameter) and writes them in the background; loading reads the checkpoint in fp32 (4).
Hybrid workers write sharded checkpoints instead (checkpoint/sharded.py): each its own shard,
from where it lies; nothing is gathered.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from fastdraft.actor.phase_peaks import PhasePeaks
from fastdraft.actor.runtime_memory import CUDA_CONTEXT_BYTES, RuntimeMemory
from fastdraft.algo.token_stats import CHUNK_BYTES
from fastdraft.engine.memory_plan import EnginePlan, largest_fitting
from fastdraft.errors import FastdraftError
from fastdraft.models import CausalLM, ModelConfig
from fastdraft.utils.device_memory import gb

if TYPE_CHECKING:
    from fastdraft.config.sections import ActorConfig

_FP32 = 4
#: Per answer token, what the chunked head keeps for the backward besides its hidden state:
#: the fp32 log-sum-exp, the target and the index_select / index_put indices (int64).
_ANSWER_SAVED = _FP32 + 3 * 8
#: The gate's statistics over a sub-chunk of CHUNK_BYTES logits: the most live at once
#: (sort values and int64 order, softmax, cumsum, masks, log p, p, centred; measured with
#: a dispatch mode in tests/actor/test_actor_memory_plan.py). A chunk's log-sum-exp makes one
#: fp32 temporary of the chunk's size inside its kernel (no dispatch mode sees it).
GATE_STATS_BYTES = 7 * CHUNK_BYTES
_WIDTH = {"float32": 4, "bfloat16": 2, "float16": 2}
MAX_RANKS = 1024   # the most ranks a refusal suggests


@dataclass(frozen=True, kw_only=True, slots=True)
class ActorShape:
    """What the actor's memory depends on; the parameter counts come from the model built on
    the meta device (ActorPlan.of)."""

    config: ModelConfig
    num_ranks: int
    compute_dtype: str
    micro_batch_tokens: int
    logits_chunk_tokens: int = 4096
    max_seq_len: int = 0
    kl: bool = False
    checkpointing: bool = False
    num_params: int
    root_params: int        # embedding, final norm, lm_head (one matrix when tied)
    layer_params: int       # one decoder layer
    largest_param: int

    @property
    def sharded(self) -> bool:   # actor/rank.py: ActorSpec.sharded
        return self.num_ranks > 1 or self.compute_dtype != "float32"

    @property
    def tokens(self) -> int:
        return max(self.micro_batch_tokens, self.max_seq_len)

    def plan(self) -> ActorPlan:
        cfg, c, ranks, tokens = self.config, _WIDTH[self.compute_dtype], self.num_ranks, self.tokens
        shard = -(-self.num_params // ranks)
        gathered = (c * (2 * self.root_params + 2 * self.layer_params)
                    + _FP32 * self.layer_params) if self.sharded else 0
        chunk_row = min(self.logits_chunk_tokens or tokens, tokens) * cfg.vocab_size
        cast = c if c != _FP32 else 0   # a compute-dtype copy beside an fp32 one
        reference_forward = (c * (self.root_params + 2 * self.layer_params)
                             + chunk_row * 2 * _FP32) if self.kl else 0
        unit_push = c * (self.root_params + 2 * self.layer_params) if self.sharded else 0
        return ActorPlan(
            shape=self, masters=_FP32 * shard, optimizer=2 * _FP32 * shard,
            reference=(c if self.sharded else _FP32) * shard if self.kl else 0,
            grads=_FP32 * shard, gathered=gathered,
            activations=tokens * (self._saved_per_token(c)
                                  + (_FP32 + 3 * c) * cfg.hidden_size    # + the final norm
                                  + _ANSWER_SAVED),                      # + the head's
            logits=chunk_row * _FP32 + max(chunk_row * _FP32, GATE_STATS_BYTES),
            logits_backward=max(chunk_row * (_FP32 + cast), reference_forward),
            push=_FP32 * self.largest_param, unit_push=unit_push,
            host=3 * _FP32 * self.num_params)


    def _saved_per_token(self, c: int) -> int:
        """What the decoder layers keep for the backward per token: every layer's activations,
        or with activation checkpointing each layer's input plus one layer's activations (the
        layer being recomputed)."""
        layer, layers = _layer_activation(self.config, c), self.config.num_hidden_layers
        if not self.checkpointing:
            return layers * layer
        return layers * c * self.config.hidden_size + layer


def _layer_activation(cfg: ModelConfig, c: int) -> int:
    """Bytes autograd saves per token in one decoder layer computing in c-byte floats
    (measured with saved-tensor hooks in tests/actor/test_actor_memory_plan.py). An RMSNorm
    keeps its fp32 input (the input itself, or its fp32 copy) and the normalised values; a
    layer norm's output is kept by the linear that reads it (QK-norm's goes to the rotation,
    which keeps nothing per token); attention keeps q, k, v, its output and its logsumexp
    (fp32 per head); the MLP its gate, up, their SiLU and product."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    norms = 2 * (_FP32 + 2 * c) * cfg.hidden_size
    qk_norm = (_FP32 + c) * (q + kv) if cfg.qk_norm else 0
    attention = c * (2 * q + 2 * kv) + _FP32 * cfg.num_attention_heads
    return norms + qk_norm + attention + 4 * c * cfg.intermediate_size


@dataclass(frozen=True, kw_only=True, slots=True)
class ActorPlan:
    """Bytes per rank (see the module docstring); host: rank 0's host memory."""

    shape: ActorShape = field(repr=False, compare=False)
    masters: int
    optimizer: int
    reference: int
    grads: int
    gathered: int
    activations: int
    logits: int
    logits_backward: int
    push: int
    unit_push: int
    host: int

    @classmethod
    def of(cls, model_config: ModelConfig, actor_cfg: ActorConfig, kl_coef: float,
           max_seq_len: int = 0) -> ActorPlan:
        with torch.device("meta"):   # shapes only
            model = CausalLM(model_config, 2)
        params = list(model.parameters())
        layer = sum(p.numel() for p in model.model.layers[0].parameters())
        total = sum(p.numel() for p in params)
        return ActorShape(
            config=model_config, num_ranks=actor_cfg.num_ranks,
            compute_dtype=actor_cfg.compute_dtype,
            micro_batch_tokens=actor_cfg.micro_batch_tokens,
            logits_chunk_tokens=actor_cfg.logits_chunk_tokens, max_seq_len=max_seq_len,
            kl=kl_coef > 0, checkpointing=actor_cfg.activation_checkpointing, num_params=total,
            root_params=total - model_config.num_hidden_layers * layer, layer_params=layer,
            largest_param=max(p.numel() for p in params)).plan()

    @property
    def state(self) -> int:
        """Held for the whole run, rollouts included."""
        return self.masters + self.optimizer + self.reference

    @property
    def update(self) -> int:
        """An update's transient at its peak: the forward's logits, then the backward's."""
        return (self.grads + self.gathered + self.activations
                + max(self.logits, self.logits_backward))

    @property
    def transient(self) -> int:
        """The larger of an update's peak and a weight push's."""
        return max(self.update, self.push)

    def sync_push(self, dtype: torch.dtype) -> int:
        """The gather of a hybrid worker's weight sync into an engine serving in `dtype`
        (ActorRank.gathered_for): a unit at a time in the compute dtype when that is `dtype`
        or fp32, else one fp32 parameter at a time."""
        s = self.shape
        if s.sharded and getattr(torch, s.compute_dtype) in (dtype, torch.float32):
            return self.unit_push
        return self.push

    @property
    def per_rank_bytes(self) -> int:
        return self.state + self.transient

    @property
    def host_bytes(self) -> int:
        return self.host

    def with_ranks(self, num_ranks: int) -> ActorPlan:
        return replace(self.shape, num_ranks=num_ranks).plan()

    def with_tokens(self, micro_batch_tokens: int) -> ActorPlan:
        return replace(self.shape, micro_batch_tokens=micro_batch_tokens).plan()

    def with_seq_len(self, max_seq_len: int) -> ActorPlan:
        return replace(self.shape, max_seq_len=max_seq_len).plan()

    def lines(self) -> list[str]:
        s = self.shape
        size = (f"{s.num_params / 1e9:.2f}B" if s.num_params >= 1e9
                else f"{s.num_params / 1e6:.1f}M")
        head = (f"actor memory plan ({size} parameters, {s.num_ranks} rank(s), "
                f"{s.compute_dtype} compute, {s.tokens} tokens a micro-batch): "
                f"{gb(self.per_rank_bytes)} a rank, {gb(self.host)} on rank 0's host")
        state = [f"masters {gb(self.masters)}", f"AdamW {gb(self.optimizer)}"]
        if self.reference:
            state.append(f"reference {gb(self.reference)}")
        update = [f"grads {gb(self.grads)}", f"gathered {gb(self.gathered)}",
                  f"activations {gb(self.activations)}",
                  f"logits {gb(self.logits)} + {gb(self.logits_backward)}"]
        push = f"weight push {gb(self.push)}"
        if self.unit_push:
            push += f", a unit at a time {gb(self.unit_push)}"
        return [head, "  state: " + " | ".join(state),
                "  update: " + " | ".join(update) + f" ({push})"]

    def as_dict(self) -> dict[str, Any]:
        s = self.shape
        return {"num_params": s.num_params, "num_ranks": s.num_ranks,
                "compute_dtype": s.compute_dtype, "tokens": s.tokens,
                **{name: getattr(self, name) for name in (
                    "masters", "optimizer", "reference", "grads", "gathered", "activations",
                    "logits", "logits_backward", "push", "unit_push", "host", "state",
                    "update", "transient", "per_rank_bytes")}}


@dataclass(frozen=True, kw_only=True, slots=True)
class RunPlan:
    """The engine and the actor on one node: device 0 (model.device) holds the engine and the
    actor's rank 0, devices 1.. a rank each; hybrid (cluster.placement=hybrid): every device
    holds an engine replica and an actor rank. A device's need is its largest phase's peak
    (actor/phase_peaks.py: rollout, update, sync), each with what every phase holds and the
    device's CUDA contexts and NCCL buffers (actor/runtime_memory.py). On a hybrid GPU the
    engine gives back its KV cache and its graphs' pool for the update and keeps them given
    back through the sync (workers/hybrid.py: the weights land before the cache returns, at
    the next generate), so neither adds to the update's transient nor to the sync's gather.
    Elsewhere the engine keeps them, and its steps, the update and the push take turns in one
    allocator's cache. On the CPU every rank and the host share RAM."""

    engine: EnginePlan
    actor: ActorPlan
    hybrid: bool = False
    # hybrid: the online drafter's trainer members on the fullest device (on the CPU: all of
    # them, one RAM), trainer/memory_plan.py
    trainer: int = 0

    @property
    def on_cpu(self) -> bool:
        return self.engine.shape.device == "cpu"

    @property
    def runtime(self) -> RuntimeMemory:
        """Device 0's CUDA contexts and NCCL communicators (hybrid: every device's)."""
        return RuntimeMemory.on_device(cuda=not self.on_cpu, hybrid=self.hybrid, device0=True,
                                       ranks=self.actor.shape.num_ranks,
                                       tensor_parallel=self.engine.shape.tensor_parallel)

    @property
    def drafter_share(self) -> int:
        """Hybrid, with a drafter trainer member: a published drafter's broadcast to every
        worker (HybridWorker.share_drafter, after the sync): its fp32 trainable tensors on the
        device and the flat buffer they cross in."""
        if not (self.hybrid and self.trainer):
            return 0
        engine = self.engine
        return 2 * _FP32 * (engine.drafter_weights // engine.shape.dtype.itemsize)

    @property
    def phases(self) -> PhasePeaks:
        """Device 0's peak in each phase (hybrid: any device's; on the CPU: the RAM's, every
        process in it)."""
        engine, actor, ranks = self.engine, self.actor, self.actor.shape.num_ranks
        if self.hybrid and self.on_cpu:   # every worker in one RAM, the KV cache kept; the
            # checkpoint written from each worker's shard in place (checkpoint/sharded.py)
            each = engine.resident + actor.state
            push = actor.sync_push(engine.shape.dtype)
            return PhasePeaks(rollout=ranks * (each + engine.step_scratch) + self.trainer,
                              update=ranks * (each + actor.update) + self.trainer,
                              sync=ranks * (each + max(push, self.drafter_share)) + self.trainer)
        if self.hybrid:   # every device the same; the trainer member beside every phase
            given_back = engine.kv_cache + engine.graph_pool
            kept = (engine.resident - given_back + actor.state + self.trainer
                    + self.runtime.nbytes)
            push = actor.sync_push(engine.shape.dtype)
            return PhasePeaks(rollout=kept + given_back + engine.step_scratch,
                              update=kept + actor.update,
                              sync=kept + max(push, self.drafter_share))
        if self.on_cpu:   # every rank's process and rank 0's checkpoint snapshot in one RAM
            kept = engine.resident + ranks * actor.state + actor.host
            return PhasePeaks(rollout=kept + engine.step_scratch,
                              update=kept + ranks * actor.update, sync=kept + ranks * actor.push)
        kept = engine.resident + actor.state + self.runtime.nbytes
        return PhasePeaks(rollout=kept + engine.step_scratch, update=kept + actor.update,
                          sync=kept + actor.push)

    @property
    def device0_bytes(self) -> int:
        """Device 0's need (hybrid: any device's; on the CPU: the RAM's): its largest phase."""
        return self.phases.peak

    @property
    def other_rank_bytes(self) -> int:
        """Outside hybrid placement on GPUs: a device of the actor's ranks 1.. (its rank, its
        process's CUDA context and the driver's, the ranks' communicator)."""
        runtime = RuntimeMemory.on_device(cuda=not self.on_cpu, hybrid=False, device0=False,
                                          ranks=self.actor.shape.num_ranks)
        return self.actor.per_rank_bytes + runtime.nbytes

    def fits(self, capacity_bytes: int, device0: bool = True) -> bool:
        """Device 0 (device0=True) and every other rank's device within capacity_bytes."""
        others = (self.on_cpu or self.hybrid or self.actor.shape.num_ranks == 1
                  or self.other_rank_bytes <= capacity_bytes)
        return others and (not device0 or self.device0_bytes <= capacity_bytes)

    def replan(self, *, slots: int | None = None, seq_len: int | None = None,
               tokens: int | None = None, ranks: int | None = None) -> RunPlan:
        """The plan with rollout.max_batch_size, rollout.max_seq_len, actor.micro_batch_tokens
        or actor.num_ranks changed."""
        engine, actor = self.engine, self.actor
        if slots is not None:
            engine = engine.with_slots(slots)
        if seq_len is not None:
            engine, actor = engine.with_seq_len(seq_len), actor.with_seq_len(seq_len)
        if tokens is not None:
            actor = actor.with_tokens(tokens)
        if ranks is not None:
            actor = actor.with_ranks(ranks)
        return replace(self, engine=engine, actor=actor)

    @property
    def engine_reserve(self) -> int:
        """What the engine must leave free on its device for the actor (RolloutEngine's
        memory_reserve): device0_bytes less the engine's own plan and its own process's CUDA
        context, which the free bytes the engine's check measures are already without."""
        own_context = CUDA_CONTEXT_BYTES if self.runtime.contexts else 0
        return self.device0_bytes - self.engine.total - own_context

    def lines(self, device_bytes: int) -> list[str]:
        ranks = self.actor.shape.num_ranks
        phases = f"  per phase: {self.phases.describe()} (the {self.phases.largest} counts)"
        if not self.on_cpu:
            phases += f"; in each: {self.runtime.describe()}"
        if self.hybrid:
            if self.on_cpu:
                members = f" + drafter trainer {gb(self.trainer)}" if self.trainer else ""
                return [f"run memory plan ({ranks} hybrid workers, one RAM, {gb(device_bytes)} "
                        f"usable): {ranks} x (engine replica + actor rank){members} "
                        f"{gb(self.device0_bytes)}", phases]
            member = f" + drafter trainer member {gb(self.trainer)}" if self.trainer else ""
            pool = (f" and graph pool ~{gb(self.engine.graph_pool)}"
                    if self.engine.graph_pool else "")
            return [f"run memory plan ({ranks} hybrid workers, {ranks} devices of "
                    f"{gb(device_bytes)} usable): every device rolls out: engine replica + "
                    f"actor rank{member} {gb(self.device0_bytes)} each (KV cache "
                    f"{gb(self.engine.kv_cache)}{pool} given back for the update and the "
                    "sync)", phases]
        if self.on_cpu:
            return [f"run memory plan (one RAM, {gb(device_bytes)} usable): engine + {ranks} "
                    f"actor rank(s) + rank 0's checkpoint snapshot {gb(self.device0_bytes)}",
                    phases]
        head = (f"run memory plan ({ranks} devices of {gb(device_bytes)} usable): device 0 "
                f"(engine + actor rank 0) {gb(self.device0_bytes)}")
        if ranks > 1:
            head += f", devices 1..{ranks - 1} {gb(self.other_rank_bytes)} each"
        return [head, phases]

    def as_dict(self) -> dict[str, Any]:
        return {"engine": self.engine.as_dict(), "actor": self.actor.as_dict(),
                "hybrid": self.hybrid, "trainer": self.trainer,
                "phases": self.phases.as_dict(), "runtime": self.runtime.as_dict(),
                "drafter_share": self.drafter_share,
                "device0_bytes": self.device0_bytes,
                "other_rank_bytes": self.other_rank_bytes,
                "engine_reserve": self.engine_reserve}


def check_run_plan(plan: RunPlan, device_capacity_bytes: int) -> None:
    """Refuses a run whose device 0 (engine + actor rank 0) or another rank's device needs more
    than device_capacity_bytes (usable bytes of one device; on the CPU: of the RAM), naming
    each setting that would make it fit on its own (or two together when none does alone)."""
    engine_plan, actor_plan = plan.engine, plan.actor
    cap = device_capacity_bytes
    if plan.fits(cap):
        return
    over = []
    if plan.device0_bytes > cap:
        member = " and a drafter trainer member" if plan.trainer else ""
        where = ("the RAM" if plan.on_cpu else f"each device (an engine replica and an actor "
                 f"rank{member})" if plan.hybrid else "device 0 (the engine and the actor's "
                 "rank 0)")
        over.append(f"{gb(plan.device0_bytes)} on {where} at its {plan.phases.largest} "
                    f"phase's peak ({plan.phases.describe()})")
    if not plan.fits(cap, device0=False):
        over.append(f"{gb(plan.other_rank_bytes)} on each other rank's device")
    raise FastdraftError(f"the run's memory plan needs {' and '.join(over)}, more than the "
                         f"{gb(cap)} usable on a device (engine {gb(engine_plan.total)}, of it "
                         f"KV cache {gb(engine_plan.kv_cache)}; actor "
                         f"{gb(actor_plan.per_rank_bytes)} a rank, activations "
                         f"{gb(actor_plan.activations)}). " + _fixes(plan, cap))


def _fixes(plan: RunPlan, cap: int) -> str:
    engine, actor = plan.engine.shape, plan.actor.shape

    def ok(p: RunPlan) -> bool:
        return p.fits(cap)

    single = []
    if slots := largest_fitting(1, engine.num_slots, lambda n: ok(plan.replan(slots=n))):
        single.append(f"lower rollout.max_batch_size to <= {slots}")
    if seq := largest_fitting(2, engine.envelope.max_seq_len,
                              lambda t: ok(plan.replan(seq_len=t))):
        single.append(f"lower rollout.max_seq_len (prompt + rollout.max_new_tokens) to <= {seq}")
    if tokens := largest_fitting(1, actor.micro_batch_tokens,
                                 lambda t: ok(plan.replan(tokens=t))):
        single.append(f"lower actor.micro_batch_tokens to <= {max(tokens, actor.max_seq_len)}")
    if not plan.on_cpu:   # more ranks: smaller shards (on the CPU they share the RAM)
        ranks = next((r for r in range(actor.num_ranks + 1, MAX_RANKS + 1)
                      if ok(plan.replan(ranks=r))), 0)
        if ranks:
            single.append(f"raise actor.num_ranks to >= {ranks}")
    if single:
        return "Any one of these fits: " + "; or ".join(single)
    # None alone: the micro-batch down to one longest sequence, and then the slots or the length.
    floor = plan.replan(tokens=min(actor.micro_batch_tokens, actor.max_seq_len or 1))
    if slots := largest_fitting(1, engine.num_slots, lambda n: ok(floor.replan(slots=n))):
        return (f"Together: lower actor.micro_batch_tokens to {actor.max_seq_len} (one longest "
                f"sequence) and rollout.max_batch_size to <= {slots}")
    if seq := largest_fitting(2, engine.envelope.max_seq_len,
                              lambda t: ok(plan.replan(seq_len=t, tokens=t))):
        return (f"Together: lower rollout.max_seq_len (prompt + rollout.max_new_tokens) and "
                f"actor.micro_batch_tokens to <= {seq}")
    return ("Nothing the recipe sets makes it fit: use devices with more memory or a smaller "
            "model")
