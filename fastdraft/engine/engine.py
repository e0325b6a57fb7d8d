"""RolloutEngine: continuous-batching generation over a paged KV cache (engine/paged_kv.py;
kv_block_size=0: static slots), speculative when asked.

step() = schedule -> propose -> verify -> accept -> postprocess (the speculative step lives in
engine/spec_step.py, prefill and plain decode in engine/plain_step.py). Without speculation
"propose" is empty and "verify" is a plain decode step. Every step is graph-static: its inputs are
copied into static buffers padded to a batch bucket and a context bucket, the device work runs as a
few stages (captured as CUDA graphs on a GPU, eager elsewhere: the same code), and its results come
back in one transfer. A callback receives each request the moment it finishes (the DataBuffer
listens), long before the batch's tail is done.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from fastdraft.config.engine import (
    KV_BLOCK_SIZE,
    OFF,
    BudgetConfig,
    SpecConfig,
    TunerConfig,
    arm_name,
)
from fastdraft.engine.buckets import BucketPlan
from fastdraft.engine.capture import (
    HiddenSink,
    emit_request_records,
    forward_aux_layers,
)
from fastdraft.engine.envelope import Envelope
from fastdraft.engine.graphs import GraphPool
from fastdraft.engine.memory_plan import (
    DrafterShape,
    EnginePlan,
    check_engine_fits,
    plan_engine,
    plan_in_memory,
)
from fastdraft.engine.migration import Handoff, Inbox, MigratedRequest
from fastdraft.engine.model_runner import ModelRunner
from fastdraft.engine.plain_step import PlainSteps
from fastdraft.engine.request import Completion, Request, generation_eos, make_requests
from fastdraft.engine.sampling_params import SamplingParams
from fastdraft.engine.scheduler import Phase, ScheduledBatch, Scheduler, SlotMove
from fastdraft.engine.sleep import Released
from fastdraft.engine.spec.budget import LengthBudget
from fastdraft.engine.spec.proposer import Proposer
from fastdraft.engine.spec.setup import make_proposer
from fastdraft.engine.spec.stats import SpecStats
from fastdraft.engine.spec.tuner import check_tuner
from fastdraft.engine.spec_step import SpeculativeStep
from fastdraft.engine.step_io import StepIO
from fastdraft.engine.trace import RolloutTrace
from fastdraft.engine.updates import BetweenSteps
from fastdraft.errors import FastdraftError
from fastdraft.models import CausalLM, HiddenStates, ModelConfig, load_model
from fastdraft.models.tensor_parallel import TPRank

OnFinish = Callable[[Completion], None]


class RolloutEngine(PlainSteps, SpeculativeStep, BetweenSteps):
    """graphs: capture steps as CUDA graphs (default: on for CUDA devices, off elsewhere);
    buckets: the batch / context padding ladders (default: graph ladders when graphs are on,
    exact sizes otherwise)."""

    captures_hidden = True   # hands out hidden states as requests finish (on_hidden)

    def __init__(self, model_path: str | Path, device: str = "cpu", max_batch_size: int = 64,
                 max_seq_len: int | None = None, dtype: torch.dtype | None = None,
                 max_prefill_tokens: int = 16384, drafter: str | Path | None = None,
                 spec: SpecConfig | None = None, compile: bool = False,
                 graphs: bool | None = None, buckets: BucketPlan | None = None,
                 capture_aux_layers: tuple[int, ...] = (),
                 tuner: TunerConfig | None = None, budget: BudgetConfig | None = None,
                 memory_reserve: int = 0, kv_block_size: int = KV_BLOCK_SIZE,
                 kv_blocks: int | None = None, paged_attention: str = "gather",
                 prefill_chunk_tokens: int = 0, tp: TPRank | None = None) -> None:
        """memory_reserve: bytes to leave free on the device for others sharing it (a run's
        actor rank 0: actor/memory_plan.py RunPlan.engine_reserve). kv_block_size: cells per
        block of the paged KV cache (0: static slots); kv_blocks: the pool's blocks (None:
        what static slots would hold, so no request ever waits for blocks); paged_attention:
        "gather" or "triton" (decode and verify steps read the blocks in place;
        model_runner.py). prefill_chunk_tokens > 0: no prefill forward computes more tokens;
        a longer prompt (or re-prefill) runs a chunk a step, decode steps between (0: one
        forward per prefill batch, up to max_prefill_tokens and at least max_seq_len). tp: this
        process is rank tp.rank of a tensor-parallel replica (models/tensor_parallel.py): every
        rank of it makes the same calls with the same arguments, in the same order."""
        dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
        spec = spec or SpecConfig()
        envelope = Envelope.for_spec(max_seq_len or 4096, spec, tuner.arms if tuner else ())
        # The memory plan from config.json alone: refused before any weight is loaded.
        plan = plan_engine(ModelConfig.from_pretrained(model_path), envelope=envelope,
                           num_slots=max_batch_size, dtype=dtype, device=device, spec=spec,
                           drafter=DrafterShape.read(drafter),
                           capture_aux_layers=capture_aux_layers,
                           max_prefill_tokens=max_prefill_tokens, graphs=graphs,
                           kv_block_size=kv_block_size, kv_blocks=kv_blocks,
                           prefill_chunk_tokens=prefill_chunk_tokens,
                           tensor_parallel=tp.size if tp is not None else 1)
        check_engine_fits(plan, device, reserved=memory_reserve)
        model = load_model(model_path, device, dtype, max_positions=envelope.rope_len, tp=tp)
        self._init(model, max_batch_size, envelope, max_prefill_tokens,
                   generation_eos(Path(model_path)), drafter, spec, compile,
                   graphs, buckets, capture_aux_layers=capture_aux_layers, tuner=tuner,
                   budget=budget, memory_plan=plan, kv_block_size=kv_block_size,
                   kv_blocks=kv_blocks, paged_attention=paged_attention,
                   prefill_chunk_tokens=prefill_chunk_tokens)

    @classmethod
    def from_model(cls, model: CausalLM, max_batch_size: int = 64, max_seq_len: int = 4096,
                   max_prefill_tokens: int = 16384, drafter: str | Path | None = None,
                   spec: SpecConfig | None = None, compile: bool = False,
                   graphs: bool | None = None, buckets: BucketPlan | None = None,
                   proposer: Proposer | None = None, share_weights: bool = False,
                   capture_aux_layers: tuple[int, ...] = (),
                   tuner: TunerConfig | None = None,
                   budget: BudgetConfig | None = None, kv_block_size: int = KV_BLOCK_SIZE,
                   kv_blocks: int | None = None, paged_attention: str = "gather",
                   prefill_chunk_tokens: int = 0) -> RolloutEngine:
        """An engine over an in-memory model. The engine runs its own copy: packing q/k/v and
        gate/up for inference re-points those parameters at views of new matrices, so an
        optimizer holding the model's parameters would silently stop training them. Weights
        cross by name (`load_weights`). share_weights=True packs and runs `model` itself (no
        copy: for inference-only models, e.g. benches on large random weights).
        proposer: an already built proposer (e.g. an EagleProposer over an in-memory drafter)
        instead of one loaded from `drafter`; its drafter borrows the embedding and lm_head of
        the model it was attached to, so attach it to `engine.model` (or share the weights)
        when the policy will be updated with `load_weights`."""
        spec = spec or SpecConfig()
        envelope = Envelope.for_spec(max_seq_len, spec, tuner.arms if tuner else ())
        if model.rope.cos.shape[0] < envelope.rope_len:
            raise FastdraftError(f"the model's rotary table covers {model.rope.cos.shape[0]} "
                                 f"positions, less than {envelope.rope_len} needed")
        if not share_weights:
            model = copy.deepcopy(model)
        engine = cls.__new__(cls)
        engine._init(model.eval(), max_batch_size, envelope, max_prefill_tokens, (), drafter,
                     spec, compile, graphs, buckets, proposer, capture_aux_layers, tuner,
                     budget, kv_block_size=kv_block_size, kv_blocks=kv_blocks,
                     paged_attention=paged_attention, prefill_chunk_tokens=prefill_chunk_tokens)
        return engine

    def _init(self, model: CausalLM, max_batch_size: int, envelope: Envelope,
              max_prefill_tokens: int, extra_eos: tuple[int, ...], drafter: str | Path | None,
              spec: SpecConfig, compile: bool = False, graphs: bool | None = None,
              buckets: BucketPlan | None = None, proposer: Proposer | None = None,
              capture_aux_layers: tuple[int, ...] = (),
              tuner: TunerConfig | None = None, budget: BudgetConfig | None = None,
              memory_plan: EnginePlan | None = None, kv_block_size: int = KV_BLOCK_SIZE,
              kv_blocks: int | None = None, paged_attention: str = "gather",
              prefill_chunk_tokens: int = 0) -> None:
        if max_batch_size < 1:
            raise FastdraftError("max_batch_size must be >= 1")
        if prefill_chunk_tokens < 0:
            raise FastdraftError("prefill_chunk_tokens must be >= 0 (0: prefill in one forward)")
        # A prefill batch's equal prompts (a GRPO group) computed once (engine/prefix_share.py);
        # False only to measure what that saves (bench kv).
        self.share_prompts = True
        if memory_plan is None:   # an in-memory model (from_model): checked here, its weights
            memory_plan = plan_in_memory(
                model, proposer, drafter, envelope=envelope, num_slots=max_batch_size,
                spec=spec, capture_aux_layers=capture_aux_layers, graphs=graphs,
                max_prefill_tokens=max_prefill_tokens, kv_block_size=kv_block_size,
                kv_blocks=kv_blocks, prefill_chunk_tokens=prefill_chunk_tokens)
        self.memory_plan = memory_plan
        self.tuner = check_tuner(tuner, spec)
        if self.tuner is not None and model.tp is not None:
            raise FastdraftError("rollout.tuner picks each step's tree by its measured time, "
                                 "which differs between the ranks of a tensor-parallel replica "
                                 "(they must decide alike): switch the tuner off with "
                                 "rollout.tensor_parallel > 1")
        self.budget = LengthBudget(budget) if budget is not None and spec.enabled else None
        self.model = model
        self.config = model.config
        self.envelope = envelope
        self.max_batch_size, self.max_seq_len = max_batch_size, envelope.max_seq_len
        # Chunked: every prefill forward within the chunk (a prompt over it is staged).
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.max_prefill_tokens = (prefill_chunk_tokens if prefill_chunk_tokens
                                   else max(max_prefill_tokens, envelope.max_seq_len))
        self.eos_token_ids = frozenset(self.config.eos_token_ids) | frozenset(extra_eos)
        self.spec = spec
        self.runner = ModelRunner(model, envelope, max_batch_size, compile, kv_block_size,
                                  kv_blocks, paged_attention, staging=prefill_chunk_tokens > 0)
        self.proposer: Proposer = proposer or make_proposer(spec, model, drafter, max_batch_size,
                                                            envelope, compile)
        # One set of aux layers per forward serves the proposer and the hidden-state capture.
        self.capture_aux_layers = tuple(capture_aux_layers)
        self.aux_layers = forward_aux_layers(self.proposer.aux_layers, self.capture_aux_layers,
                                             self.config.num_hidden_layers)
        self.hidden_sink: HiddenSink | None = None  # set for the length of a generate call
        device = self.runner.device
        self.graphs = GraphPool(device, graphs)
        self._released = Released()   # device memory given back by sleep (engine/sleep.py)
        self.buckets = buckets or BucketPlan.build(max_batch_size, envelope.cache_len,
                                                   exact=not self.graphs.enabled)
        self.eager_shortcuts = device.type == "cpu" and not self.graphs.enabled
        self.io = StepIO(max_batch_size, envelope, self.config.hidden_size,
                         len(self.aux_layers), self.config.vocab_size, device,
                         self.runner.dtype)
        self.policy_version = 0
        self.drafter_version: int | None = 0 if spec.method != "none" else None
        self.rl_step = 0
        self.last_stats = SpecStats()
        self.last_trace = RolloutTrace()
        self.last_migrated: list[MigratedRequest] = []   # what the last generate handed back
        self.fallback_reason: str | None = None
        # What the last step ran, made, and how many of its rows verified a tree.
        self.last_arm, self.last_num_tokens, self.last_num_drafting = "prefill", 0, 0

    # ----------------------------------------------------------------------------- public API
    @property
    def eager_shortcuts(self) -> bool:
        """Eager CPU steps may read values on the host (to end a loop early, to read a paged
        cache's rows in chunks by length): nothing waits for a device there. Captured graphs
        (and CUDA) never do; tests switch this off to check."""
        return self._eager_shortcuts

    @eager_shortcuts.setter
    def eager_shortcuts(self, on: bool) -> None:
        self._eager_shortcuts = on
        self.runner.ragged_reads = (on and self.runner.pages is not None
                                    and not self.runner.compiled)

    def generate(self, prompt_token_ids: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None, *,
                 on_finish: OnFinish | None = None, on_hidden: HiddenSink | None = None,
                 use_tqdm: bool | None = None, stream_ids: list[int] | None = None,
                 resume: list[MigratedRequest] | None = None, inbox: Inbox | None = None,
                 yield_below: int = 0, should_yield: Callable[[], bool] | None = None
                 ) -> list[Completion]:
        """Generates one completion per prompt; returns them in prompt order. Aggregated spec
        statistics of the call are in `engine.last_stats`. on_hidden receives the policy's
        hidden states of every committed token (engine/capture.py), step by step. stream_ids:
        each prompt's random stream (default: its index; engine/request.make_requests).

        Migration (engine/migration.py; without these arguments nothing changes): resume:
        requests another engine yielded, continued here (the prompts may then be []); inbox:
        drained at every step boundary, closed when the call ends. Their completions follow
        the prompts' (resume's, then the inbox's in arrival order), under the indices they
        came with, which may repeat the prompts' own. yield_below > 0: after a step that
        leaves fewer (but some) unfinished requests, and should_yield() agrees, the call
        stops: its unfinished requests go to `engine.last_migrated` (index order), and the
        list returned holds only the finished ones (then partial: use Completion.index)."""
        if yield_below and self.model.tp is not None:
            raise ValueError("a tensor-parallel replica's ranks cannot yield requests on a "
                             "signal each reads by itself: no migration with tp")
        self.wake()   # memory given back while a colocated actor updated (engine/updates.py)
        requests = make_requests(prompt_token_ids, params, self.config.vocab_size,
                                 self.max_seq_len, self.eos_token_ids, stream_ids)
        handoff = Handoff(self.config.vocab_size, self.max_seq_len, self.eos_token_ids, inbox,
                          yield_below, should_yield)
        requests += handoff.receive(resume or [])
        pages = self.runner.pages
        if pages is not None:
            pages.reset()   # whatever a broken call left, no request holds now
        scheduler = Scheduler(self.max_batch_size, self.max_prefill_tokens,
                              pages if pages is not None and pages.bounded else None,
                              self.prefill_chunk_tokens)
        for request in requests:
            scheduler.add(request)
        self.last_stats, self.last_migrated = SpecStats(), []
        self.last_trace = trace = RolloutTrace(num_requests=len(requests))
        show = use_tqdm if use_tqdm is not None else len(requests) >= 64
        results: dict[int, Completion] = {}   # by id(request): indices may repeat (migration)
        self.hidden_sink = on_hidden
        captured = self.graphs.stats.num_graphs, self.graphs.stats.capture_s
        try:
            with tqdm(total=len(requests), desc="rollout", unit="req", disable=not show) as bar:
                while True:
                    arrivals = handoff.refill(scheduler)  # closes the inbox when out of work
                    requests += arrivals
                    trace.num_requests = bar.total = len(requests)
                    if not scheduler.has_work:
                        break
                    trace.record(len(requests) - len(results))
                    finished = self.step(scheduler)
                    trace.end_step(self.last_arm, self.last_num_tokens,
                                   self.last_num_drafting)
                    self._record_finished(finished, results, bar, on_finish)
                    if handoff.yields(scheduler):
                        break
        finally:
            self.last_migrated = handoff.finish(scheduler, self.proposer)
            self.hidden_sink = None
            trace.graph_captures = self.graphs.stats.num_graphs - captured[0]
            trace.graph_capture_s = self.graphs.stats.capture_s - captured[1]
        trace.finish()
        return [results[id(r)] for r in requests if id(r) in results]

    def _record_finished(self, finished: list[Request], results: dict[int, Completion],
                         bar: tqdm, on_finish: OnFinish | None) -> None:
        for request in finished:
            self.proposer.on_finish(request)
            if self.budget is not None:
                self.budget.record(request.prompt_key, len(request.output_token_ids))
            self.last_stats.merge(request.spec)
            completion = request.to_completion(self.policy_version, self.drafter_version,
                                               with_spec=self.spec.enabled)
            results[id(request)] = completion
            bar.update(1)
            if on_finish is not None:
                on_finish(completion)

    # ------------------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self, scheduler: Scheduler) -> list[Request]:
        batch = scheduler.schedule()
        pages = self.runner.pages
        if batch.phase is Phase.DECODE and pages is not None and pages.bounded:
            batch = self._make_room(scheduler, batch)
        if batch.phase is Phase.PREFILL:
            self.last_arm, self.last_num_drafting = "prefill", 0
            finished = self._prefill(scheduler, batch)
        else:
            finished = self._generate_step(scheduler, batch)
        if pages is not None:   # finished requests' blocks back before their slots refill
            pages.release([r.slot for r in finished])
        self._move(scheduler.take_moves())  # keep the running requests in slots 0..n-1
        if pages is not None and self.last_num_drafting:   # rejected tree cells' blocks back
            pages.trim({r.slot: r.num_tokens - 1 for r in scheduler.running})
        return finished

    def _make_room(self, scheduler: Scheduler, batch: ScheduledBatch) -> ScheduledBatch:
        """Paged KV: while the free blocks cannot cover this step's writes (every row's next
        token and the largest draft tree's cells), the running request that has made the least
        progress is preempted: its blocks are freed, and it waits to be recomputed."""
        pages = self.runner.pages
        assert pages is not None
        while True:
            ends = [r.num_tokens + self.envelope.tree_cells for r in scheduler.running]
            if pages.blocks_to_write(ends) <= pages.num_free or len(scheduler.running) == 1:
                break
            victim = min(reversed(scheduler.running), key=lambda r: len(r.output_token_ids))
            pages.release([victim.slot])
            self.proposer.on_preempt(victim)   # its drafter state is rebuilt on resuming
            scheduler.preempt(victim)
            self._move(scheduler.take_moves())
            self.last_trace.preemptions += 1
        return ScheduledBatch(Phase.DECODE, list(scheduler.running))

    def _move(self, moves: list[SlotMove]) -> None:
        if moves:
            self.runner.move(moves)
            self.proposer.move(moves)
            self.io.sampling.move(moves)

    def _generate_step(self, scheduler: Scheduler, batch: ScheduledBatch) -> list[Request]:
        """One decode or speculative step: the spec's tree, or the tuner's arm for this batch
        size, whose reward (tokens produced per second of the step) it then records."""
        cfg, num_spec = self.spec, len(batch.requests)
        if self.budget is not None and cfg.enabled:   # rows setting the makespan in slots 0..
            batch, num_spec = self._put_long_first(scheduler, batch)
        tuned = self.tuner is not None and cfg.enabled and num_spec > 0
        if tuned:  # the tuner's bucket: the rows its arm speculates on
            cfg = self.tuner.select(num_spec)
        if not num_spec:
            cfg = OFF
        start = time.perf_counter()
        finished = (self._speculate(scheduler, batch, cfg, num_spec) if cfg.enabled
                    else self._decode(scheduler, batch))
        elapsed = time.perf_counter() - start
        self.last_arm = arm_name(cfg)
        self.last_num_drafting = num_spec if cfg.enabled else 0
        if tuned:
            self.tuner.record(cfg, self.last_num_tokens, num_spec, elapsed)
        return finished

    def reserve_cells(self, ends: list[int]) -> None:
        """Paged KV: row b's blocks cover cells up to ends[b] - 1 before a step writes them."""
        if self.runner.pages is not None:
            self.runner.pages.reserve(ends)

    def _postprocess(self, scheduler: Scheduler, batch: ScheduledBatch,
                     token_ids: list[list[int]], logprobs: list[list[float]]) -> list[Request]:
        num_before = [len(r.output_token_ids) for r in batch.requests]
        finished = scheduler.postprocess(batch, token_ids, logprobs)
        self.last_num_tokens = sum(len(r.output_token_ids) for r in batch.requests) - sum(
            num_before)   # what the step made: the trace's and the tuner's count
        if self.spec.enabled:
            done = {id(r) for r in finished}
            for r, before in zip(batch.requests, num_before):
                if id(r) not in done and len(r.output_token_ids) > before:
                    self.proposer.on_tokens(r, r.output_token_ids[before:])
        return finished

    def _capture(self, requests: list[Request], starts: list[int],
                 hidden: HiddenStates | None = None) -> None:
        """Hands the sink the step's hidden states (default: the commit buffers)."""
        assert self.hidden_sink is not None
        final, aux = ((hidden.final, hidden.aux) if hidden is not None
                      else (self.io.commit_final, self.io.commit_aux))
        emit_request_records(self.hidden_sink, requests, starts, final,
                             aux if self.capture_aux_layers else (), self.policy_version)

