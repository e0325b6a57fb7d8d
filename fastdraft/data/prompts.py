"""The prompts of each RL step and how their answers are scored.

A step's prompts depend only on (data.seed, step): a resumed run continues with exactly the
prompts the interrupted one would have used. Task prompts (the bootstrap's modsum) are fresh
problems every step, or a pool of task problems drawn once; a pool, like a prompt file
(parquet / JSONL), is visited in a shuffled order, epoch after epoch. Task problems are scored
by the task's verifier, file prompts by a registered reward against their answer."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastdraft.config.sections import DataConfig
from fastdraft.data.checks import bad_row
from fastdraft.data.tasks import Problem, get_task
from fastdraft.errors import FastdraftError


@dataclass(frozen=True, slots=True)
class PromptItem:
    ids: list[int]
    text: str
    answer: str
    problem: Problem | None = None      # task prompts: what the task's verifier scores with


class PromptSource:
    def __init__(self, cfg: DataConfig, tokenizer: Any, max_prompt_len: int,
                 rows: list[dict[str, Any]] | None = None) -> None:
        """rows: the prompt file's rows, already loaded and checked (else loaded here)."""
        self.cfg, self.tokenizer = cfg, tokenizer
        special = cfg.add_special_tokens if cfg.add_special_tokens is not None else cfg.task is None
        self._special = special
        self.task = get_task(cfg.task, **cfg.task_options) if cfg.task is not None else None
        self.rows: list[dict[str, Any]] = []
        if cfg.path is not None:
            from fastdraft.data.files import load_prompts
            from fastdraft.data.rewards import get_reward
            self.reward_fn = get_reward(cfg.reward)
            self.rows = rows if rows is not None else load_prompts(
                Path(cfg.path).expanduser(), cfg.prompt_key, cfg.answer_key)
            lengths = [len(self._encode(row["prompt"])) for row in self.rows]
            if 0 in lengths:   # text the tokenizer has no token for (a prompt is >= 1 token)
                raise bad_row(Path(cfg.path), lengths.index(0), cfg.prompt_key, "prompt",
                              "turns into no tokens with the policy's tokenizer")
            over = [i for i, n in enumerate(lengths) if n > max_prompt_len]
            if over:
                raise FastdraftError(
                    f"{cfg.path}: row {over[0]}'s prompt has {lengths[over[0]]} tokens "
                    f"({len(over)} of {len(lengths)} rows are over), more than the "
                    f"{max_prompt_len} rollout.max_seq_len leaves after max_new_tokens: raise "
                    "rollout.max_seq_len or drop those rows")
        self.pool: list[PromptItem] = []
        if self.task is not None and cfg.task_pool is not None:
            rng = random.Random(f"{cfg.seed}/pool")
            problems = [self.task.sample(rng) for _ in range(cfg.task_pool)]
            self.pool = [PromptItem(self._encode(p.prompt), p.prompt, p.answer, p)
                         for p in problems]
        self.max_prompt_len = max_prompt_len

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=self._special))

    def batch(self, step: int, num_prompts: int, round_: int = 0) -> list[PromptItem]:
        """Step `step`'s prompts: fresh task problems, or the next of the dataset's epochs (each
        shuffled by the seed). round_ > 0: the step's r-th resampling round draws from a stream
        of its own (the same for the same step and round, so a resumed run draws it again)."""
        stream = f"{self.cfg.seed}/resample{round_}" if round_ else f"{self.cfg.seed}"
        if self.task is not None and not self.pool:
            rng = random.Random(f"{stream}/{step}")
            problems = [self.task.sample(rng) for _ in range(num_prompts)]
            return [PromptItem(self._encode(p.prompt), p.prompt, p.answer, p) for p in problems]
        size = len(self.pool) if self.pool else len(self.rows)
        items = []
        for k in range(step * num_prompts, (step + 1) * num_prompts):
            epoch, pos = divmod(k, size)
            order = list(range(size))
            random.Random(f"{stream}/epoch{epoch}").shuffle(order)
            items.append(self.pool[order[pos]] if self.pool else self._row(order[pos]))
        return items

    def _row(self, index: int) -> PromptItem:
        row = self.rows[index]
        return PromptItem(self._encode(row["prompt"]), row["prompt"], row["answer"])

    def score(self, item: PromptItem, completion_text: str) -> float:
        if item.problem is not None and self.task is not None:
            return float(self.task.reward(item.problem, completion_text))
        return float(self.reward_fn(completion_text, item.answer))
