"""RolloutEngine: continuous-batching generation over the slot KV cache, speculative when asked.

step() = schedule -> propose -> verify -> accept -> postprocess. Without speculation "propose" is
empty and "verify" is a plain decode step. A callback receives each request the moment it
finishes (the DataBuffer listens), long before the batch's tail is done.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from fastdraft.engine.model_runner import ModelRunner
from fastdraft.engine.request import Completion, Request
from fastdraft.engine.sampler import SamplingTensors, sample, sample_greedy
from fastdraft.engine.sampling_params import SamplingParams
from fastdraft.engine.scheduler import Phase, ScheduledBatch, Scheduler
from fastdraft.engine.spec.batch import DraftBatch
from fastdraft.engine.spec.config import SpecConfig
from fastdraft.engine.spec.proposer import Committed, Proposer
from fastdraft.engine.spec.setup import make_proposer
from fastdraft.engine.spec.stats import SpecStats
from fastdraft.engine.spec.tree import Accepted
from fastdraft.engine.spec.verify import verify_batch, verify_greedy_batch
from fastdraft.models import CausalLM, load_model, load_named_tensors

OnFinish = Callable[[Completion], None]


class RolloutEngine:
    def __init__(self, model_path: str | Path, device: str = "cpu", max_batch_size: int = 64,
                 max_seq_len: int | None = None, dtype: torch.dtype | None = None,
                 max_prefill_tokens: int = 16384, drafter: str | Path | None = None,
                 spec: SpecConfig | None = None, compile: bool = False) -> None:
        dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
        max_seq_len = max_seq_len or 4096
        spec = spec or SpecConfig()
        model = load_model(model_path, device, dtype, max_positions=_rope_len(max_seq_len, spec))
        self._init(model, max_batch_size, max_seq_len, max_prefill_tokens,
                   _generation_eos(Path(model_path)), drafter, spec, compile)

    @classmethod
    def from_model(cls, model: CausalLM, max_batch_size: int = 64, max_seq_len: int = 4096,
                   max_prefill_tokens: int = 16384, drafter: str | Path | None = None,
                   spec: SpecConfig | None = None) -> RolloutEngine:
        """Wraps an in-memory model (it keeps its storage: load_weights updates it in place)."""
        spec = spec or SpecConfig()
        if model.rope.cos.shape[0] < _rope_len(max_seq_len, spec):
            raise ValueError(f"the model's rotary table covers {model.rope.cos.shape[0]} "
                             f"positions, less than {_rope_len(max_seq_len, spec)} needed")
        engine = cls.__new__(cls)
        engine._init(model.eval(), max_batch_size, max_seq_len, max_prefill_tokens, (),
                     drafter, spec)
        return engine

    def _init(self, model: CausalLM, max_batch_size: int, max_seq_len: int,
              max_prefill_tokens: int, extra_eos: tuple[int, ...], drafter: str | Path | None,
              spec: SpecConfig, compile: bool = False) -> None:
        if max_batch_size < 1 or max_seq_len < 2:
            raise ValueError("max_batch_size must be >= 1 and max_seq_len >= 2")
        self.model = model
        self.config = model.config
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.max_prefill_tokens = max(max_prefill_tokens, max_seq_len)
        self.eos_token_ids = frozenset(self.config.eos_token_ids) | frozenset(extra_eos)
        self.spec = spec
        # Tree nodes sit in scratch cells past the committed tokens: the cache holds them too.
        cache_len = max_seq_len + (spec.tokens_to_verify + 1 if spec.enabled else 0)
        self.runner = ModelRunner(model, max_batch_size, cache_len, compile)
        self.proposer: Proposer = make_proposer(spec, model, drafter, max_batch_size, cache_len,
                                                compile)
        self.policy_version = 0
        self.drafter_version: int | None = 0 if spec.method != "none" else None
        self.rl_step = 0
        self.last_stats = SpecStats()

    # ----------------------------------------------------------------------------- public API
    def generate(self, prompt_token_ids: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None, *,
                 on_finish: OnFinish | None = None,
                 use_tqdm: bool | None = None) -> list[Completion]:
        """Generates one completion per prompt; returns them in prompt order. Aggregated spec
        statistics of the call are in `engine.last_stats`."""
        requests = self._make_requests(prompt_token_ids, params)
        scheduler = Scheduler(self.max_batch_size, self.max_prefill_tokens)
        for request in requests:
            scheduler.add(request)
        self.last_stats = SpecStats()
        show = use_tqdm if use_tqdm is not None else len(requests) >= 64
        results: list[Completion | None] = [None] * len(requests)
        with tqdm(total=len(requests), desc="rollout", unit="req", disable=not show) as bar:
            while scheduler.has_work:
                for request in self.step(scheduler):
                    self.proposer.on_finish(request)
                    self.last_stats.merge(request.spec)
                    completion = request.to_completion(self.policy_version, self.drafter_version,
                                                       with_spec=self.spec.enabled)
                    results[request.index] = completion
                    bar.update(1)
                    if on_finish is not None:
                        on_finish(completion)
        return [c for c in results if c is not None]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                     version: int | None = None) -> int:
        """Updates the policy in place (HF names); returns the new policy version."""
        load_named_tensors(self.model, named_tensors)
        self.policy_version = self.policy_version + 1 if version is None else version
        return self.policy_version

    def load_drafter_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                             version: int | None = None) -> int:
        """Updates the drafter's trainable tensors in place; returns the new drafter version."""
        drafter = getattr(self.proposer, "drafter", None)
        if drafter is None:
            raise ValueError(f"spec method {self.spec.method!r} has no drafter to update")
        load_named_tensors(drafter, named_tensors)
        self.drafter_version = (self.drafter_version or 0) + 1 if version is None else version
        return self.drafter_version

    def advance_step(self) -> None:
        """Marks the end of an RL step (model-free drafters slide their rollout window)."""
        self.rl_step += 1
        self.proposer.advance_step(self.rl_step)

    # ------------------------------------------------------------------------------ one step
    def step(self, scheduler: Scheduler) -> list[Request]:
        batch = scheduler.schedule()
        if batch.phase is Phase.PREFILL:
            return self._prefill(scheduler, batch)
        if self.spec.enabled:
            return self._speculate(scheduler, batch)
        requests = batch.requests
        logits = self.runner.decode([r.last_token_id for r in requests],
                                    [r.num_tokens - 1 for r in requests],
                                    [r.slot for r in requests])
        return self._sample_one(scheduler, batch, logits)

    def _sample_one(self, scheduler: Scheduler, batch: ScheduledBatch,
                    logits: torch.Tensor) -> list[Request]:
        requests = batch.requests
        if all(r.params.is_greedy for r in requests):  # the common eval path: no tensors to build
            token_ids, logprobs = sample_greedy(logits)
        else:
            st = SamplingTensors.build([r.params for r in requests], logits.shape[-1],
                                       logits.device)
            token_ids, logprobs = sample(logits, st, [r.generator for r in requests])
        return scheduler.postprocess(batch, [[t] for t in token_ids.tolist()],
                                     [[lp] for lp in logprobs.tolist()])

    def _prefill(self, scheduler: Scheduler, batch: ScheduledBatch) -> list[Request]:
        requests = batch.requests
        logits, hidden = self.runner.prefill([r.prompt_token_ids for r in requests],
                                             [r.slot for r in requests], self.proposer.aux_layers)
        finished = self._sample_one(scheduler, batch, logits)
        if self.spec.enabled:
            done = {id(r) for r in finished}
            self.proposer.on_commit([
                Committed(r, r.prompt_token_ids[1:] + r.output_token_ids, 1,
                          hidden.final[b, : len(r.prompt_token_ids)],
                          tuple(a[b, : len(r.prompt_token_ids)] for a in hidden.aux))
                for b, r in enumerate(requests) if id(r) not in done])
        return finished

    def _speculate(self, scheduler: Scheduler, batch: ScheduledBatch) -> list[Request]:
        """propose -> verify (one policy forward over every tree) -> accept -> postprocess."""
        requests = batch.requests
        drafts = self.proposer.propose(requests, self.spec)
        root_pos = [r.num_tokens - 1 for r in requests]
        logits, hidden = self.runner.verify([r.last_token_id for r in requests], root_pos, drafts,
                                            [r.slot for r in requests], self.proposer.aux_layers)
        accepted = self._accept(requests, drafts, logits)
        start = self.runner.tree_start(root_pos)
        slots, src, dst = [], [], []
        for r, p, acc in zip(requests, root_pos, accepted):
            for j, node in enumerate(acc.node_ids):
                slots.append(r.slot)
                src.append(start + node)
                dst.append(p + 1 + j)
        self.runner.compact(slots, src, dst)
        num_before = [len(r.output_token_ids) for r in requests]
        finished = scheduler.postprocess(batch, [a.token_ids for a in accepted],
                                         [a.logprobs for a in accepted])
        self._record_stats(requests, drafts, accepted, num_before)
        done = {id(r) for r in finished}
        committed = []
        for b, (r, p, acc) in enumerate(zip(requests, root_pos, accepted)):
            if id(r) in done:
                continue
            # The policy's hidden states of the root and the accepted nodes: the token before
            # each newly committed token.
            rows = [0, *(1 + n for n in acc.node_ids)]
            committed.append(Committed(r, acc.token_ids, p + 1, hidden.final[b, rows],
                                       tuple(a[b, rows] for a in hidden.aux)))
        self.proposer.on_commit(committed)
        return finished

    @staticmethod
    def _accept(requests: list[Request], drafts: DraftBatch, logits: torch.Tensor
                ) -> list[Accepted]:
        if all(r.params.is_greedy for r in requests):
            return verify_greedy_batch(drafts, logits)
        return verify_batch(drafts, logits, [r.params for r in requests],
                            [r.generator for r in requests])

    @staticmethod
    def _record_stats(requests: list[Request], drafts: DraftBatch, accepted: list[Accepted],
                      num_before: list[int]) -> None:
        """Counts the accepted draft tokens the request kept: a path that runs past a stop token
        (or the length limit) is cut there, and what lies beyond never becomes output."""
        sources, depths = drafts.sources.tolist(), drafts.depths.tolist()
        for b, (r, acc, before) in enumerate(zip(requests, accepted, num_before)):
            n = drafts.num_nodes[b]
            kept = acc.node_ids[: len(r.output_token_ids) - before]
            r.spec.record(n, max(depths[b][:n], default=0), [sources[b][i] for i in kept])

    # ------------------------------------------------------------------------------- helpers
    def _make_requests(self, prompts: list[list[int]],
                       params: SamplingParams | list[SamplingParams] | None) -> list[Request]:
        """Checks every prompt before any work starts, so bad input loses nothing."""
        params = params or SamplingParams()
        per_request = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_request) != len(prompts):
            raise ValueError(f"got {len(per_request)} SamplingParams for {len(prompts)} prompts")
        vocab = self.config.vocab_size
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, per_request)):
            prompt = list(prompt)
            if not prompt:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
            if len(prompt) >= self.max_seq_len:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens; the KV cache holds "
                                 f"max_seq_len={self.max_seq_len} (prompt + answer): shorten the "
                                 "prompt or raise max_seq_len")
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")
            stop = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos
                                                  else self.eos_token_ids)
            generator = None
            if p.seed is not None and not p.is_greedy:
                generator = torch.Generator(self.runner.device).manual_seed(p.seed + i)
            requests.append(Request(i, prompt, p, stop, self.max_seq_len, generator))
        return requests


def _rope_len(max_seq_len: int, spec: SpecConfig) -> int:
    """Positions the rotary tables must cover: the cache plus the deepest draft beyond it."""
    return max_seq_len + (spec.tokens_to_verify + spec.depth + 2 if spec.enabled else 0)


def _generation_eos(model_dir: Path) -> tuple[int, ...]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
