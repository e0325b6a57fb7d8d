"""A request's life in the engine (mutable, scheduler-owned) and the record it leaves."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from fastdraft.engine.rng import seed_of
from fastdraft.engine.sampling_params import SamplingParams
from fastdraft.engine.spec.stats import SpecStats
from fastdraft.errors import FastdraftError


class FinishReason(StrEnum):
    STOP = "stop"        # a stop / EOS token was generated (it is included in token_ids)
    LENGTH = "length"    # max_new_tokens reached, or the KV cache slot is full


@dataclass(frozen=True, slots=True)
class Completion:
    index: int                       # the prompt's position in the generate() call (a
                                     # migrated request: the index it arrived with)
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int
    drafter_version: int | None = None
    spec: SpecStats | None = None    # None when the engine does not speculate


def prompt_key(prompt_token_ids: list[int]) -> int:
    """The same prompt gets the same key in every RL step (and process: ints hash stably)."""
    return hash(tuple(prompt_token_ids))


@dataclass(slots=True)
class Request:
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int]
    max_total_len: int               # prompt + generated tokens must fit the cache slot
    seed: int = 0                    # int64 key of the request's random stream (engine/rng.py)
    slot: int = -1
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    preemptions: int = 0             # times its KV blocks were taken back (paged_kv.py)
    prompt_key: int = field(init=False)   # the prompt's identity across RL steps (budgets)

    def __post_init__(self) -> None:
        self.prompt_key = prompt_key(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prefill_len(self) -> int:
        """Tokens a prefill of this request runs over: every token but the one its next step
        feeds. A fresh request has no such token yet (its prefill samples it); a migrated one
        arriving with answer tokens (engine/migration.py) feeds its last one next, exactly as
        the engine it left would have."""
        return self.num_tokens - 1 if self.output_token_ids else self.num_tokens

    @property
    def prefill_token_ids(self) -> list[int]:
        return (self.prompt_token_ids + self.output_token_ids)[: self.prefill_len]

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def append(self, token_id: int, logprob: float) -> bool:
        """Records one generated token; returns True when the request just finished."""
        self.output_token_ids.append(token_id)
        self.output_logprobs.append(logprob)
        if token_id in self.stop_token_ids:
            self.finish_reason = FinishReason.STOP
        elif (len(self.output_token_ids) >= self.params.max_new_tokens
              or self.num_tokens >= self.max_total_len):
            self.finish_reason = FinishReason.LENGTH
        return self.finish_reason is not None

    def extend(self, token_ids: list[int], logprobs: list[float]) -> bool:
        """Appends tokens up to the first that finishes the request; True when it finished."""
        return any(self.append(t, lp) for t, lp in zip(token_ids, logprobs))

    def to_completion(self, policy_version: int, drafter_version: int | None = None,
                      with_spec: bool = False) -> Completion:
        assert self.finish_reason is not None
        return Completion(self.index, self.prompt_token_ids, self.output_token_ids,
                          self.output_logprobs, self.finish_reason, policy_version,
                          drafter_version, self.spec if with_spec else None)


def make_requests(prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None,
                  vocab: int, max_seq_len: int, eos_token_ids: frozenset[int],
                  stream_ids: list[int] | None = None) -> list[Request]:
    """Checks every prompt before any work starts, so bad input loses nothing. Request i draws
    from the random stream of (seed, stream_ids[i]) (default i): a caller that splits one
    rollout over several engines passes each prompt's index in the whole rollout, so where a
    request runs never changes what it samples."""
    params = params or SamplingParams()
    per_request = params if isinstance(params, list) else [params] * len(prompts)
    if len(per_request) != len(prompts):
        raise FastdraftError(f"got {len(per_request)} SamplingParams for {len(prompts)} prompts")
    streams = list(range(len(prompts))) if stream_ids is None else list(stream_ids)
    if len(streams) != len(prompts):
        raise FastdraftError(f"got {len(streams)} stream ids for {len(prompts)} prompts")
    requests = []
    for i, (prompt, p) in enumerate(zip(prompts, per_request)):
        prompt = list(prompt)
        if not prompt:
            raise FastdraftError(f"prompt {i} is empty: every prompt needs at least one token")
        if len(prompt) >= max_seq_len:
            raise FastdraftError(f"prompt {i} has {len(prompt)} tokens; the KV cache holds "
                                 f"max_seq_len={max_seq_len} (prompt + answer): shorten the "
                                 "prompt or raise max_seq_len")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise FastdraftError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")
        stop = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos
                                              else eos_token_ids)
        seed = 0 if p.is_greedy else seed_of(p.seed, streams[i])
        requests.append(Request(i, prompt, p, stop, max_seq_len, seed))
    return requests


def generation_eos(model_dir: Path) -> tuple[int, ...]:
    """The extra stop tokens a checkpoint's generation_config.json names."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
