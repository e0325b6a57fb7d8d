"""`fastdraft drafter warmup`: train a drafter offline on the policy's own rollouts and hidden
states (TLT's warm-up step), so speculation starts from a useful drafter."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from fastdraft.drafter.base import Drafter, build_drafter
from fastdraft.drafter.checkpoint import save_drafter
from fastdraft.drafter.losses import DEFAULT_NUM_STEPS, drafter_loss
from fastdraft.engine import RolloutEngine, SamplingParams
from fastdraft.errors import FastdraftError
from fastdraft.models import CausalLM, load_model
from fastdraft.utils.schedule import warmup_cosine_lr

Log = Callable[[str], None]


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmupConfig:
    kind: str = "eagle1"
    num_rollouts: int = 2048
    rollout_temperature: float = 1.0
    max_new_tokens: int = 160
    steps: int = 4000
    batch_size: int = 32
    lr: float = 2e-3
    warmup_steps: int = 50
    seed: int = 0
    # Unrolled training steps (the drafter fed its own features, as deeper draft levels are);
    # None = the kind's default (losses.DEFAULT_NUM_STEPS: EAGLE-1 2, EAGLE-3 3).
    ttt_steps: int | None = None
    # Score only pairs that draft answer tokens: prompt positions are never drafted in a rollout.
    response_only: bool = True
    # Share of the policy's argmax (one-hot) in the drafter's CE target (losses.ce_target):
    # raises greedy acceptance, at some cost to sampled acceptance where the policy is flat.
    argmax_weight: float = 0.0
    # Draft vocabulary: the N most frequent tokens of the warm-up answers (None: every token).
    # A draft level then reads N rows of the lm_head instead of all (FR-Spec); drafts stay
    # lossless (other tokens just have q = 0).
    draft_vocab: int | None = None

    @classmethod
    def for_steps(cls, **kwargs: Any) -> WarmupConfig:
        """A warm-up of `steps` (the CLI's --steps): its lr warm-up the default's 50 steps, or a
        tenth of a run of no more steps than that."""
        defaults = {f.name: f.default for f in fields(cls)}
        steps, ramp = kwargs.get("steps", defaults["steps"]), defaults["warmup_steps"]
        kwargs.setdefault("warmup_steps", ramp if steps > ramp else max(steps, 0) // 10)
        return cls(**kwargs)

    def __post_init__(self) -> None:
        if self.kind not in DEFAULT_NUM_STEPS:   # first: nothing else matters for a bad kind
            raise FastdraftError(f"unknown drafter kind {self.kind!r}; choose one of "
                                 f"{sorted(DEFAULT_NUM_STEPS)}")
        for name in ("num_rollouts", "max_new_tokens", "steps", "batch_size"):
            if getattr(self, name) < 1:
                raise FastdraftError(f"the drafter warm-up's {name} must be >= 1 (--"
                                     f"{name.replace('_', '-')}), got {getattr(self, name)}")
        if not self.lr > 0 or not 0 <= self.warmup_steps < self.steps:
            raise FastdraftError(f"the drafter warm-up's lr must be > 0 and its lr warm-up "
                                 f"({self.warmup_steps} steps) shorter than its {self.steps} "
                                 "steps")
        if not 0.0 <= self.argmax_weight <= 1.0:
            raise FastdraftError(f"WarmupConfig.argmax_weight must be in [0, 1], got "
                                 f"{self.argmax_weight}")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise FastdraftError("WarmupConfig.draft_vocab must be >= 1 (or None for every token)")
        if self.ttt_steps is not None and self.ttt_steps < 1:
            raise FastdraftError("WarmupConfig.ttt_steps must be >= 1 (or None for the default)")
        if self.ttt_steps is None:
            # Recorded as a number, so a saved drafter says what it was trained with and a
            # changed default makes `ensure_drafter` retrain a cached one.
            object.__setattr__(self, "ttt_steps", DEFAULT_NUM_STEPS[self.kind])


@dataclass(frozen=True, slots=True)
class WarmupReport:
    drafter_dir: Path
    kind: str
    num_rollouts: int
    train_tokens: int
    rollout_seconds: float
    train_seconds: float
    final_loss: float
    final_top1_acc: float
    captured_tokens: int = 0   # tokens of the rollouts (the device warm-up's capture)


def collect_rollouts(policy: CausalLM, prompts: list[list[int]], cfg: WarmupConfig
                     ) -> list[list[int]]:
    """prompt + completion token ids sampled from the policy itself."""
    max_len = max(map(len, prompts)) + cfg.max_new_tokens + 1
    engine = RolloutEngine.from_model(policy, max_batch_size=64, max_seq_len=max_len)
    params = SamplingParams(temperature=cfg.rollout_temperature, seed=cfg.seed,
                            max_new_tokens=cfg.max_new_tokens)
    return [c.prompt_token_ids + c.token_ids for c in engine.generate(prompts, params)]


def first_drafted_pair(prompt_len: int) -> int:
    """Index t of the first (feature t, token t + 1) pair whose prediction is a drafted answer
    token (t + 2 >= prompt_len): after prefill the drafter predicts answer token 2 from the pair
    (last prompt token, answer token 1)."""
    return max(prompt_len - 2, 0)


def _batches(seqs: list[list[int]], batch_size: int, rng: random.Random,
             score_from: list[int] | None = None):
    """Endless length-bucketed right-padded batches: (input_ids [B, T], valid [B, T]); valid
    marks the tokens that may be scored, from score_from[i] on (default: all)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    chunks = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
    while True:
        rng.shuffle(chunks)
        for chunk in chunks:
            width = max(len(seqs[i]) for i in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            valid = torch.zeros(len(chunk), width, dtype=torch.bool)
            for row, i in enumerate(chunk):
                ids[row, : len(seqs[i])] = torch.tensor(seqs[i])
                valid[row, (score_from[i] if score_from else 0): len(seqs[i])] = True
            yield ids, valid


def train_drafter(drafter: Drafter, policy: CausalLM, seqs: list[list[int]], cfg: WarmupConfig,
                  log: Log = print, score_from: list[int] | None = None
                  ) -> tuple[int, dict[str, float]]:
    """AdamW + warmup/cosine over the rollouts; returns (tokens seen, last logged metrics).
    score_from[i]: first position of sequence i whose pair is scored (default: all)."""
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=0.0)
    batches = _batches(seqs, cfg.batch_size, random.Random(cfg.seed), score_from)
    drafter.train()
    tokens, window = 0, []
    metrics: dict[str, float] = {}
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = warmup_cosine_lr(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                                           total_steps=cfg.steps, min_ratio=0.05)
        ids, valid = next(batches)
        with torch.no_grad():
            positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
            _, hidden = policy(ids, positions, aux_layers=drafter.aux_layers)
        loss, m = drafter_loss(drafter, ids, hidden, valid, policy.lm_head,
                               num_steps=cfg.ttt_steps, argmax_weight=cfg.argmax_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        tokens += int(valid.sum())
        window.append(m)
        if (step + 1) % 100 == 0 or step + 1 == cfg.steps:
            metrics = {k: sum(w[k] for w in window) / len(window) for k in window[0]}
            log(f"drafter step {step + 1}/{cfg.steps} " +
                " ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
            window = []
    drafter.eval()
    return tokens, metrics


def frequent_tokens(seqs: list[list[int]], n: int, score_from: list[int] | None = None
                    ) -> torch.Tensor:
    """The n most frequent tokens of the sequences (from score_from[i] on: the drafted ones),
    ties broken by token id; fewer when fewer distinct tokens occur."""
    counts: dict[int, int] = {}
    for i, seq in enumerate(seqs):
        for tok in seq[(score_from[i] + 2 if score_from else 0):]:  # the answer tokens
            counts[tok] = counts.get(tok, 0) + 1
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:n]
    return torch.tensor(sorted(ranked), dtype=torch.long)


def warmup_drafter(policy_dir: str | Path, out_dir: str | Path, prompts: list[list[int]],
                   cfg: WarmupConfig = WarmupConfig(), log: Log = print,
                   meta: dict | None = None) -> WarmupReport:
    """Trains and saves a drafter; `meta` adds entries to its drafter_config.json."""
    policy = load_model(policy_dir, max_positions=warmup_positions(prompts, cfg))
    return warmup_policy(policy, out_dir, prompts, cfg, log, meta)


def warmup_positions(prompts: list[list[int]], cfg: WarmupConfig) -> int:
    """The positions a warm-up's policy needs: the longest prompt and its answer."""
    return max(map(len, prompts)) + cfg.max_new_tokens + 2


def warmup_policy(policy: CausalLM, out_dir: str | Path, prompts: list[list[int]],
                  cfg: WarmupConfig = WarmupConfig(), log: Log = print,
                  meta: dict | None = None) -> WarmupReport:
    """warmup_drafter on a policy in memory (frozen here; at least warmup_positions)."""
    torch.manual_seed(cfg.seed)
    for p in policy.parameters():
        p.requires_grad_(False)
    start = time.perf_counter()
    seqs = collect_rollouts(policy, prompts, cfg)
    rollout_s = time.perf_counter() - start
    log(f"collected {len(seqs)} rollouts ({sum(map(len, seqs))} tokens) in {rollout_s:.1f}s")
    drafter = build_drafter(cfg.kind, policy.config, policy.rope.cos.shape[0]).attach(policy)
    start = time.perf_counter()
    score_from = ([first_drafted_pair(len(p)) for p in prompts] if cfg.response_only else None)
    if cfg.draft_vocab is not None:
        drafter.draft_token_ids = frequent_tokens(seqs, cfg.draft_vocab, score_from)
        log(f"draft vocabulary: the {len(drafter.draft_token_ids)} most frequent answer tokens")
    tokens, metrics = train_drafter(drafter, policy, seqs, cfg, log, score_from)
    train_s = time.perf_counter() - start
    save_drafter(drafter, out_dir, extra={"warmup": asdict(cfg), **(meta or {})})
    return WarmupReport(Path(out_dir), cfg.kind, len(seqs), tokens, rollout_s, train_s,
                        metrics.get("loss", math.nan), metrics.get("top1_acc", math.nan))
