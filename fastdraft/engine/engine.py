"""RolloutEngine: continuous-batching generation over the slot KV cache.

step() = schedule -> forward (prefill or decode) -> sample -> postprocess; a callback receives each
request the moment it finishes (the DataBuffer listens), long before the batch's tail is done.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from fastdraft.engine.model_runner import ModelRunner
from fastdraft.engine.request import Completion, Request
from fastdraft.engine.sampler import SamplingTensors, sample
from fastdraft.engine.sampling_params import SamplingParams
from fastdraft.engine.scheduler import Phase, Scheduler
from fastdraft.models import CausalLM, load_model, load_named_tensors

OnFinish = Callable[[Completion], None]


class RolloutEngine:
    def __init__(self, model_path: str | Path, device: str = "cpu", max_batch_size: int = 64,
                 max_seq_len: int | None = None, dtype: torch.dtype | None = None,
                 max_prefill_tokens: int = 16384) -> None:
        dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
        max_seq_len = max_seq_len or 4096
        model = load_model(model_path, device, dtype, max_positions=max_seq_len)
        self._init(model, max_batch_size, max_seq_len, max_prefill_tokens,
                   _generation_eos(Path(model_path)))

    @classmethod
    def from_model(cls, model: CausalLM, max_batch_size: int = 64, max_seq_len: int = 4096,
                   max_prefill_tokens: int = 16384) -> RolloutEngine:
        """Wraps an in-memory model (it keeps its storage: load_weights updates it in place)."""
        if model.rope.cos.shape[0] < max_seq_len:
            raise ValueError(f"the model's rotary table covers {model.rope.cos.shape[0]} "
                             f"positions, less than max_seq_len={max_seq_len}")
        engine = cls.__new__(cls)
        engine._init(model.eval(), max_batch_size, max_seq_len, max_prefill_tokens, ())
        return engine

    def _init(self, model: CausalLM, max_batch_size: int, max_seq_len: int,
              max_prefill_tokens: int, extra_eos: tuple[int, ...]) -> None:
        if max_batch_size < 1 or max_seq_len < 2:
            raise ValueError("max_batch_size must be >= 1 and max_seq_len >= 2")
        self.model = model
        self.config = model.config
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.max_prefill_tokens = max(max_prefill_tokens, max_seq_len)
        self.eos_token_ids = frozenset(self.config.eos_token_ids) | frozenset(extra_eos)
        self.runner = ModelRunner(model, max_batch_size, max_seq_len)
        self.policy_version = 0

    # ----------------------------------------------------------------------------- public API
    def generate(self, prompt_token_ids: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None, *,
                 on_finish: OnFinish | None = None,
                 use_tqdm: bool | None = None) -> list[Completion]:
        """Generates one completion per prompt; returns them in prompt order."""
        requests = self._make_requests(prompt_token_ids, params)
        scheduler = Scheduler(self.max_batch_size, self.max_prefill_tokens)
        for request in requests:
            scheduler.add(request)
        show = use_tqdm if use_tqdm is not None else len(requests) >= 64
        results: list[Completion | None] = [None] * len(requests)
        with tqdm(total=len(requests), desc="rollout", unit="req", disable=not show) as bar:
            while scheduler.has_work:
                for request in self.step(scheduler):
                    completion = request.to_completion(self.policy_version)
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

    # ------------------------------------------------------------------------------ one step
    def step(self, scheduler: Scheduler) -> list[Request]:
        batch = scheduler.schedule()
        requests = batch.requests
        slots = [r.slot for r in requests]
        if batch.phase is Phase.PREFILL:
            logits = self.runner.prefill([r.prompt_token_ids for r in requests], slots)
        else:
            logits = self.runner.decode([r.last_token_id for r in requests],
                                        [r.num_tokens - 1 for r in requests], slots)
        st = SamplingTensors.build([r.params for r in requests], logits.shape[-1], logits.device)
        token_ids, logprobs = sample(logits, st, [r.generator for r in requests])
        return scheduler.postprocess(batch, token_ids.tolist(), logprobs.tolist())

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


def _generation_eos(model_dir: Path) -> tuple[int, ...]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
