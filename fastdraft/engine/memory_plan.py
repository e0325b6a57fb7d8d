"""The engine's memory plan: the bytes a RolloutEngine will hold on its device, from shapes alone
(config.json, the envelope, the slot count, the dtype, the drafter's kind), so that a plan the
device cannot hold is refused before anything is allocated.

What it counts (EnginePlan):
- weights: the policy in the serving dtype and its fp32 rotary tables (packing q/k/v and
  gate/up re-points the parameters at views of the packed matrices: no second copy stays);
- kv_cache: paged (engine/paged_kv.py): [layers, 2, kv_blocks + 1, block_size, kv_heads,
  head_dim] and the block tables [slots, cache_len / block_size]; kv_blocks defaults to what
  static slots would hold (every slot sized for the longest sequence: prompt + answer + a
  tree's cells), or is set smaller (rollout.kv_cache_gb: answers use far less; requests then
  wait for blocks, and one is preempted when they run out). Static slots (block size 0):
  [layers, 2, slots, kv_heads, cache_len, head_dim];
- drafter_weights: EAGLE's own layers (it borrows the policy's embedding and lm_head) and its
  draft head's rows of a draft vocabulary; drafter_kv: its one layer's slot cache and the
  slots' root features;
- step_buffers: StepIO's static tensors (step_io.py); the largest is the table of draft
  probabilities [slots, 1 + nodes, vocab] fp32 that a sampled tree's q lands in;
- step_scratch / graph_pool: an estimate of the transient tensors of the largest step (checked
  on the CPU against the live bytes of real steps, tests/engine/test_engine_memory_plan.py). The
  verify stage of a sampled tree dominates: logits [slots * (1 + nodes), vocab] in the serving
  dtype and the rejection walk's fp32 tables of that size (scaled logits, the one-hot of
  greedy rows, p, the stacked (p, q) pair, the log-softmax: VERIFY_FP32_COPIES), one layer's
  activations of those rows, the walk's (p, q) state and the accepted path's logprob rows. A
  sampled draft's q tables (spec/eagle.py) come next; top-k / top-p filtering adds its sort's
  temporaries (not counted). On CUDA every captured stage shares one graph pool, which keeps
  the largest captured stage's peak for good (graph_pool), plus GRAPH_POOL_SLACK: other
  stages' kept outputs, cuBLAS workspaces, the pool's segment rounding (the 7B bench measured
  826 MB for 44 graphs at batch <= 8, where the verify tables are ~0.1 GB); prefill is eager,
  and its peak (step_scratch) returns to the allocator's cache. On the CPU every step's
  scratch comes and goes: step_scratch is the largest peak, graph_pool 0.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from fastdraft.config.engine import SpecConfig
from fastdraft.drafter import Drafter, build_drafter
from fastdraft.drafter.checkpoint import CONFIG_FILE, saved_options
from fastdraft.engine.capture import forward_aux_layers
from fastdraft.engine.envelope import Envelope
from fastdraft.engine.paged_kv import check_kv_blocks
from fastdraft.engine.rng import Stream
from fastdraft.errors import FastdraftError
from fastdraft.models import CausalLM, ModelConfig
from fastdraft.models.tensor_parallel import TPRank, shard_config
from fastdraft.utils.device_memory import GIB, Capacity, device_capacity, gb

VERIFY_FP32_COPIES = 6
GRAPH_POOL_SLACK = GIB
_LONG, _FP32 = 8, 4


@dataclass(frozen=True, kw_only=True, slots=True)
class DrafterShape:
    """What the plan needs of an EAGLE drafter: its kind, its draft vocabulary (None: all), and
    an imported drafter's own lm_head rows and aux layers (None: none, the kind's default)."""

    kind: str
    draft_vocab: int | None = None
    head_rows: int | None = None
    aux_layers: tuple[int, ...] | None = None

    @classmethod
    def read(cls, path: str | Path | None, proposer: object = None) -> DrafterShape | None:
        """A given proposer's drafter (in memory), else drafter_config.json at path (no weights
        read); None when there is none (loading the drafter then says why)."""
        given = getattr(proposer, "drafter", None)
        if isinstance(given, Drafter):
            return cls.of(given)
        file = Path(path) / CONFIG_FILE if path is not None else None
        if file is None or not file.is_file():
            return None
        meta = json.loads(file.read_text())
        ids, options = meta.get("draft_token_ids"), saved_options(meta)
        return cls(kind=meta["kind"], draft_vocab=None if ids is None else len(ids),
                   head_rows=options["head_rows"], aux_layers=options["aux_layers"])

    @classmethod
    def of(cls, drafter: Drafter) -> DrafterShape:
        ids, options = drafter.draft_token_ids, drafter.options
        return cls(kind=drafter.kind, draft_vocab=None if ids is None else len(ids),
                   head_rows=options["head_rows"], aux_layers=options["aux_layers"])


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineShape:
    """What an engine's memory depends on. weights and drafter_weights are counted once from
    modules built on the meta device (plan_engine); the rest is arithmetic on the sizes."""

    config: ModelConfig
    envelope: Envelope
    num_slots: int
    dtype: torch.dtype
    device: str
    weights: int
    drafter_weights: int = 0
    drafts_on_device: bool = False      # an EAGLE drafter: its cache, roots and q tables
    num_aux: int = 0                    # policy layers whose inputs a step keeps
    max_prefill_tokens: int = 16384
    graphs: bool = False
    kv_block_size: int = 0              # 0: static slots
    kv_blocks: int | None = None        # None: what static slots would hold
    prefill_chunk_tokens: int = 0       # > 0: a staging slot, no prefill forward over this
    tensor_parallel: int = 1            # k: one rank of a replica over k (1/k of the KV heads)

    @property
    def local(self) -> ModelConfig:
        """The policy as one rank holds it (models/tensor_parallel.py)."""
        return shard_config(self.config, self.tensor_parallel)

    @property
    def kv_slots(self) -> int:
        """Slots of cache: the batch's, and the staging slot of a chunked prefill."""
        return self.num_slots + (1 if self.prefill_chunk_tokens else 0)

    @property
    def prefill_tokens(self) -> int:
        """The most tokens one prefill forward computes."""
        if self.prefill_chunk_tokens:
            return self.prefill_chunk_tokens
        return max(self.max_prefill_tokens, self.envelope.max_seq_len)

    @property
    def cell_bytes(self) -> int:
        """Bytes of one cache cell: K and V of every layer (this rank's KV heads)."""
        cfg = self.local
        return 2 * cfg.num_key_value_heads * cfg.head_dim * self.dtype.itemsize * (
            cfg.num_hidden_layers)

    @property
    def num_kv_blocks(self) -> int:
        if self.kv_blocks is not None:
            return self.kv_blocks
        return self.kv_slots * -(-self.envelope.cache_len // self.kv_block_size)

    def _kv_cache(self) -> int:
        if not self.kv_block_size:
            return self.kv_slots * self.envelope.cache_len * self.cell_bytes
        max_blocks = -(-self.envelope.cache_len // self.kv_block_size)
        return ((self.num_kv_blocks + 1) * self.kv_block_size * self.cell_bytes
                + self.kv_slots * max_blocks * _LONG)

    def plan(self) -> EnginePlan:
        cfg, env, slots, width = self.config, self.envelope, self.num_slots, self.dtype.itemsize
        kv_cell = 2 * cfg.num_key_value_heads * cfg.head_dim * width   # K and V, one layer
        drafter_kv = (slots * (env.cache_len * kv_cell + cfg.hidden_size * width)
                      if self.drafts_on_device else 0)
        return EnginePlan(shape=self, weights=self.weights, kv_cache=self._kv_cache(),
                          drafter_weights=self.drafter_weights, drafter_kv=drafter_kv,
                          step_buffers=self._step_buffers(), **self._scratch())

    def _step_buffers(self) -> int:
        """StepIO's tensors, per slot (step_io.py, slot_state.py, spec/batch.py)."""
        cfg, env, width = self.config, self.envelope, self.dtype.itemsize
        cols, nodes = env.commit_width, env.max_tree_nodes
        per_slot = (4 * _LONG                                   # rows in, on host and device
                    + 4 + _LONG + 4 + 1 + _LONG * len(Stream)  # sampling settings and keys
                    + (3 + 3 * cols) * 8                        # the transfer out, float64
                    + (cols + 1) * _LONG                        # accepted ids and counts
                    + (1 + self.num_aux) * cols * cfg.hidden_size * width)
        if nodes:   # draft trees: tokens, parents, depths, ancestors, count, sources, sampled
            per_slot += nodes * (3 * _LONG + 2) + nodes * nodes + _LONG
            if self.drafts_on_device:   # the sampled trees' q (allocated on the first one)
                per_slot += (nodes + 1) * cfg.vocab_size * _FP32
        return self.num_slots * per_slot

    def _scratch(self) -> dict[str, int]:
        """graph_pool (captured stages, held for good) and step_scratch (eager, transient)."""
        cfg, env, slots, width = self.local, self.envelope, self.num_slots, self.dtype.itemsize
        vocab, hidden = cfg.vocab_size, cfg.hidden_size
        q_size = cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        # One layer's transients a token (residual, norm, q/k/v, attention out, gate/up and
        # their product), and the hidden states a forward returns (final + aux).
        act = (4 * hidden + 2 * q_size + 2 * kv_size + 4 * cfg.intermediate_size
               + (1 + self.num_aux) * hidden) * width
        nodes, depth, topk = env.max_tree_nodes, env.max_depth, env.max_topk
        decode = slots * (vocab * (width + 3 * _FP32) + act)
        verify = (slots * (1 + nodes) * (vocab * (width + VERIFY_FP32_COPIES * _FP32) + act)
                  + slots * (2 * 2 + depth + 1) * vocab * _FP32)   # walk state, path rows
        expanded = max(depth - 1, 0) * topk
        draft = (slots * vocab * _FP32 * ((1 + expanded) + expanded + nodes + (nodes + 1))
                 if self.drafts_on_device and nodes else 0)
        # A prefill forward: its tokens' transients, its mask [tokens, context] (bool, and the
        # additive copy SDPA makes), the logits; chunked, the staged prompt's hidden states.
        tokens = self.prefill_tokens
        prefill = (tokens * act + tokens * env.max_seq_len * (1 + width)
                   + slots * vocab * _FP32)
        if self.prefill_chunk_tokens:
            prefill += env.max_seq_len * (1 + self.num_aux) * hidden * width
        captured = max(decode, verify if nodes else 0, draft)
        if self.graphs:   # the pool keeps the captured peak; eager prefill needs its own
            return {"graph_pool": captured + GRAPH_POOL_SLACK, "step_scratch": prefill}
        return {"graph_pool": 0, "step_scratch": max(captured, prefill)}


@dataclass(frozen=True, kw_only=True, slots=True)
class EnginePlan:
    """Bytes on the engine's device, by what holds them (see the module docstring)."""

    shape: EngineShape = field(repr=False, compare=False)
    weights: int
    kv_cache: int
    drafter_weights: int
    drafter_kv: int
    step_buffers: int
    graph_pool: int        # CUDA graphs: the captured stages' scratch, held for good
    step_scratch: int      # eager steps' transient peak (with graphs: prefill's)

    @property
    def total(self) -> int:
        return self.resident + self.step_scratch

    @property
    def resident(self) -> int:
        """Held for the engine's life; step_scratch comes and goes, and returns to the
        allocator's cache, which others in the process (the actor's rank 0) reuse."""
        return (self.weights + self.kv_cache + self.drafter_weights + self.drafter_kv
                + self.step_buffers + self.graph_pool)

    def with_slots(self, num_slots: int) -> EnginePlan:
        return replace(self.shape, num_slots=num_slots).plan()

    def with_seq_len(self, max_seq_len: int) -> EnginePlan:
        return replace(self.shape, envelope=replace(self.shape.envelope,
                                                    max_seq_len=max_seq_len)).plan()

    def max_slots_within(self, budget: int) -> int:
        """The most slots (up to this plan's) whose plan fits in budget bytes; 0: none."""
        return largest_fitting(1, self.shape.num_slots,
                               lambda n: self.with_slots(n).total <= budget)

    def max_seq_len_within(self, budget: int) -> int:
        """The longest max_seq_len (up to this plan's) whose plan fits; 0: none."""
        return largest_fitting(2, self.shape.envelope.max_seq_len,
                               lambda t: self.with_seq_len(t).total <= budget)

    def lines(self, capacity: Capacity | None = None) -> list[str]:
        """One compact block: the head line (and the capacity it is checked against), then
        the parts."""
        s = self.shape
        head = (f"engine memory plan ({s.device}, {str(s.dtype).removeprefix('torch.')}, "
                f"{s.num_slots} slots x {s.envelope.cache_len} cells"
                + (f", one rank of {s.tensor_parallel}" if s.tensor_parallel > 1 else "")
                + f"): {gb(self.total)}")
        if capacity is not None:
            head += f" of {capacity.describe()}"
        kv = f"KV cache {gb(self.kv_cache)}"
        if s.kv_block_size:
            cells = s.num_kv_blocks * s.kv_block_size
            kv += (f" paged ({s.num_kv_blocks} blocks of {s.kv_block_size} cells: "
                   f"{cells // s.envelope.cache_len} longest sequences at once)")
        parts = [f"weights {gb(self.weights)}", kv]
        if s.drafts_on_device:
            parts.append(f"drafter {gb(self.drafter_weights)} + KV {gb(self.drafter_kv)}")
        parts.append(f"step buffers {gb(self.step_buffers)}")
        if s.graphs:
            parts.append(f"graph pool ~{gb(self.graph_pool)}")
        parts.append(f"{'prefill' if s.graphs else 'step'} scratch ~{gb(self.step_scratch)}")
        return [head, "  " + " | ".join(parts)]

    def as_dict(self) -> dict[str, int | str]:
        return {"device": self.shape.device,
                "dtype": str(self.shape.dtype).removeprefix("torch."),
                "num_slots": self.shape.num_slots, "cache_len": self.shape.envelope.cache_len,
                "tensor_parallel": self.shape.tensor_parallel,
                "kv_block_size": self.shape.kv_block_size,
                "kv_blocks": self.shape.num_kv_blocks if self.shape.kv_block_size else 0,
                "weights": self.weights, "kv_cache": self.kv_cache,
                "drafter_weights": self.drafter_weights, "drafter_kv": self.drafter_kv,
                "step_buffers": self.step_buffers, "graph_pool": self.graph_pool,
                "step_scratch": self.step_scratch, "total": self.total}


def plan_engine(config: ModelConfig, *, envelope: Envelope, num_slots: int,
                dtype: torch.dtype, device: str | torch.device, spec: SpecConfig,
                drafter: DrafterShape | None = None, capture_aux_layers: tuple[int, ...] = (),
                max_prefill_tokens: int = 16384, graphs: bool | None = None,
                kv_block_size: int = 0, kv_blocks: int | None = None,
                prefill_chunk_tokens: int = 0, tensor_parallel: int = 1) -> EnginePlan:
    """The plan of RolloutEngine(...) with these settings; drafter: the EAGLE drafter's shape
    when spec drafts with one (None: no drafter memory is planned). tensor_parallel: the plan
    of one rank of a replica over that many (the drafter is replicated on every rank)."""
    device = str(torch.device(device))
    with torch.device("meta"):   # shapes only: nothing is allocated
        policy = CausalLM(config, envelope.rope_len, TPRank(0, tensor_parallel))
        eagle = (build_drafter(drafter.kind, config, envelope.rope_len,
                               aux_layers=drafter.aux_layers, head_rows=drafter.head_rows)
                 if drafter is not None and spec.uses_drafter else None)
    width = dtype.itemsize
    weights = _param_count(policy) * width + _buffer_count(policy) * _FP32
    drafter_weights, drafter_aux = 0, ()
    if eagle is not None:   # load_drafter casts its rotary tables to the dtype too
        subset_copy = 0 if eagle.head is not None else (drafter.draft_vocab or 0)   # DraftHead
        drafter_weights = (_param_count(eagle) + _buffer_count(eagle)
                           + subset_copy * config.hidden_size) * width
        drafter_aux = tuple(eagle.aux_layers)
    aux = forward_aux_layers(drafter_aux, tuple(capture_aux_layers), config.num_hidden_layers)
    if kv_blocks is not None and kv_block_size:   # PagedKV's refusal, before any allocation
        check_kv_blocks(kv_blocks, envelope.cache_len, kv_block_size)
    shape = EngineShape(config=config, envelope=envelope, num_slots=num_slots, dtype=dtype,
                        device=device, weights=weights, drafter_weights=drafter_weights,
                        drafts_on_device=eagle is not None, num_aux=len(aux),
                        max_prefill_tokens=max(max_prefill_tokens, envelope.max_seq_len),
                        graphs=device.startswith("cuda") if graphs is None else graphs,
                        kv_block_size=kv_block_size, kv_blocks=kv_blocks,
                        prefill_chunk_tokens=prefill_chunk_tokens,
                        tensor_parallel=tensor_parallel)
    return shape.plan()


def check_engine_plan(plan: EnginePlan, capacity: Capacity, resident: int = 0) -> None:
    """Refuses a plan whose bytes still to allocate (total - resident: what is in memory
    already, e.g. an in-memory model's weights) exceed what the capacity leaves usable, with
    the slot count and sequence length that would fit."""
    if plan.total - resident <= capacity.usable:
        return
    budget = capacity.usable + resident
    s = plan.shape
    need = plan.total - resident
    if s.kv_blocks is not None:
        kv_what = (f"{s.kv_blocks} blocks of {s.kv_block_size} cells x {gb(s.cell_bytes)}: "
                   "rollout.kv_cache_gb")
    else:
        kv_what = (f"{s.num_slots} slots x {s.envelope.cache_len} cells x {gb(s.cell_bytes)}: "
                   "every slot holds the longest sequence")
    message = (f"the engine's memory plan needs {gb(need)} more, but {capacity.describe()}"
               f"; its KV cache alone is {gb(plan.kv_cache)} ({kv_what}). ")
    fixes = []
    kv_room = budget - (plan.total - plan.kv_cache)
    if s.kv_block_size and kv_room > 0:
        fixes.append(f"rollout.kv_cache_gb to <= {kv_room / 1e9:.1f} (the paged cache's size: "
                     "requests wait for blocks, and the least advanced is preempted and "
                     "recomputed when answers outgrow it)")
    slots = plan.max_slots_within(budget) if s.kv_blocks is None else 0
    seq_len = plan.max_seq_len_within(budget) if s.kv_blocks is None else 0
    if slots:
        fixes.append(f"rollout.max_batch_size (the engine's max_batch_size) to <= {slots} "
                     f"(slots that fit at max_seq_len {s.envelope.max_seq_len})")
    if seq_len:
        fixes.append(f"rollout.max_seq_len (prompt + rollout.max_new_tokens) to <= {seq_len} "
                     f"tokens (what fits at {s.num_slots} slots)")
    if not fixes:
        raise FastdraftError(message + f"Not even one slot fits beside the weights "
                             f"({gb(plan.weights)}): use a device with more memory or a smaller "
                             "model.dtype")
    raise FastdraftError(message + "Lower " + ", or ".join(fixes))


def plan_in_memory(model: CausalLM, proposer: object, drafter: str | Path | None,
                   **settings: Any) -> EnginePlan:
    """The plan of an engine over an in-memory model (RolloutEngine.from_model; settings:
    plan_engine's), checked with what is in memory already: the weights, and a given
    proposer's drafter and caches."""
    param = next(model.parameters())
    plan = plan_engine(model.config, dtype=param.dtype, device=param.device,
                       drafter=DrafterShape.read(drafter, proposer),
                       tensor_parallel=model.tp.size if model.tp is not None else 1, **settings)
    resident = plan.weights + (plan.drafter_weights + plan.drafter_kv
                               if proposer is not None else 0)
    check_engine_fits(plan, param.device, resident=resident)
    return plan


def check_engine_fits(plan: EnginePlan, device: str | torch.device, reserved: int = 0,
                      resident: int = 0) -> None:
    """Prints the plan against `device`'s capacity (reserved: bytes kept for others there) and
    refuses it if it does not fit."""
    capacity = device_capacity(device, reserved)
    print("\n".join(plan.lines(capacity)))
    check_engine_plan(plan, capacity, resident)


def largest_fitting(low: int, high: int, fits: Callable[[int], bool]) -> int:
    """The largest n in [low, high] with fits(n) (fits is monotone: true up to some n); 0 when
    even low does not fit."""
    if high < low or not fits(low):
        return 0
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _param_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())   # tied parameters count once


def _buffer_count(module: torch.nn.Module) -> int:
    return sum(b.numel() for b in module.buffers())
