"""The bootstrapped tiny policy: its model, its data encoding and its supervised training loop
(what it trains: ``spec.py``).

No machine here downloads a model, so the CPU recipe trains its own policy for about 100 s on a
verifiable synthetic task (``modsum``), deterministically (``determinism.py``). The policy is
meant to be *imperfect*: good on short problems, worse on long ones, so that RL has room to
improve it and its answer lengths keep the task's long tail (the thing speculative rollouts
speed up).

Sequences are ``prompt chars + solution chars + <eos>`` with no ``<bos>``: prompts then encode
the same way through ``encode_prompt`` and through the plain tokenizer (which adds no specials),
so no consumer can feed the policy a prompt format it never saw. The loss covers exactly the
solution tokens and the final ``<eos>``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from fastdraft.bootstrap.determinism import deterministic_cpu
from fastdraft.bootstrap.spec import BootstrapSpec
from fastdraft.bootstrap.tokenizer import DEFAULT_ALPHABET, vocab_size_for
from fastdraft.data.tasks import Problem, Task, get_task
from fastdraft.models import CausalLM, ModelConfig
from fastdraft.models.config import FAMILIES
from fastdraft.utils.schedule import warmup_cosine_lr

IGNORE_INDEX = -100
EOS_ID, BOS_ID = 1, 2


def model_config(spec: BootstrapSpec) -> ModelConfig:
    """The policy's config (Qwen2 or Qwen3 per ``spec.architecture``); the vocabulary is the
    default char tokenizer's. The family's switches (Qwen2: qkv bias; Qwen3: QK-norm, no bias)
    come from the same reader that loads its config.json, so the trained model is exactly what
    a reload of the checkpoint builds."""
    return ModelConfig(
        model_type=spec.architecture, vocab_size=vocab_size_for(DEFAULT_ALPHABET),
        hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.attention_head_dim,
        rope_theta=spec.rope_theta, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True, eos_token_ids=(EOS_ID,), bos_token_id=BOS_ID,
        **FAMILIES[spec.architecture]({}))


def init_weights(model: CausalLM, std: float = 0.02) -> None:
    """HF-style init (normal(0, std) weights, zero biases): CausalLM leaves torch's defaults,
    whose N(0, 1) embedding, tied to lm_head, would start training at huge logits."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear | torch.nn.Embedding):
            torch.nn.init.normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:
                torch.nn.init.zeros_(module.bias)
    model.tie_weights()


class _Encoder(Protocol):
    """What the encoders need of an HF tokenizer (structural, so tests may pass a fake)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def encode_prompt(tokenizer: _Encoder, prompt: str) -> list[int]:
    """Token ids of a prompt as the policy was trained on it (chars only, no <bos>)."""
    return list(tokenizer.encode(prompt, add_special_tokens=False))


@dataclass(frozen=True, slots=True)
class Example:
    """input_ids: prompt + solution + <eos>; labels: next-token targets, IGNORE_INDEX on the
    prompt (labels[t] is the target predicted at position t, so only solution+EOS are scored)."""

    input_ids: list[int]
    labels: list[int]


def encode_example(tokenizer: _Encoder, problem: Problem) -> Example:
    prompt = encode_prompt(tokenizer, problem.prompt)
    answer = [*tokenizer.encode(problem.solution, add_special_tokens=False), EOS_ID]
    ids = prompt + answer
    labels = [IGNORE_INDEX] * (len(prompt) - 1) + answer + [IGNORE_INDEX]
    return Example(ids, labels)


@dataclass(frozen=True, slots=True)
class Batch:
    """Right-padded [B, T] tensors; padding has label IGNORE_INDEX (causal attention means
    padding after a sequence never affects its real tokens)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor


def collate(examples: Sequence[Example]) -> Batch:
    width = max(len(e.input_ids) for e in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    for row, e in enumerate(examples):
        ids[row, : len(e.input_ids)] = torch.tensor(e.input_ids)
        labels[row, : len(e.labels)] = torch.tensor(e.labels)
    positions = torch.arange(width).expand(len(examples), -1)
    return Batch(ids, positions, labels)


def batch_stream(task: Task, tokenizer: _Encoder, spec: BootstrapSpec, rng: random.Random,
                 exclude_prompts: frozenset[str] = frozenset()) -> Iterator[Batch]:
    """Endless length-bucketed batches of fresh random problems (deterministic given ``rng``);
    problems whose prompt is in ``exclude_prompts`` (the held-out set) are skipped, and those
    longer than ``spec.thin_above_tokens`` are kept with probability ``spec.thin_keep``."""
    while True:
        pool: list[Example] = []
        while len(pool) < spec.batch_size * spec.bucket_batches:
            problem = task.sample(rng)
            if problem.prompt in exclude_prompts:
                continue
            example = encode_example(tokenizer, problem)
            if (spec.thin_keep < 1 and len(example.input_ids) > spec.thin_above_tokens
                    and rng.random() >= spec.thin_keep):
                continue
            pool.append(example)
        pool.sort(key=lambda e: len(e.input_ids))
        chunks = [pool[i: i + spec.batch_size] for i in range(0, len(pool), spec.batch_size)]
        rng.shuffle(chunks)
        for chunk in chunks:
            yield collate(chunk)


def lr_at(step: int, spec: BootstrapSpec) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    return warmup_cosine_lr(step, lr=spec.lr, warmup_steps=spec.warmup_steps,
                            total_steps=spec.steps, min_ratio=spec.min_lr_ratio)


def loss_on(model: CausalLM, batch: Batch) -> torch.Tensor:
    """Next-token cross-entropy on the labelled (solution + EOS) tokens, averaged per sequence
    and then over the batch: every problem weighs the same, so the many short problems (which
    teach the digit arithmetic fastest and dominate accuracy) are not drowned out by the token
    mass of the rare long ones."""
    logits, _ = model(batch.input_ids, batch.positions)
    per_token = F.cross_entropy(logits.transpose(1, 2), batch.labels, ignore_index=IGNORE_INDEX,
                                reduction="none")  # [B, T], 0 where ignored
    counts = (batch.labels != IGNORE_INDEX).sum(1).clamp(min=1)
    return (per_token.sum(1) / counts).mean()


@torch.no_grad()
def exact_match_rate(model: CausalLM, batch: Batch) -> float:
    """Fraction of the batch's problems whose every labelled token is the argmax given the
    reference prefix (one teacher-forced forward): exactly those that greedy decoding solves
    step by step. Leaves the model in the mode it found."""
    was_training = model.training
    model.eval()
    logits, _ = model(batch.input_ids, batch.positions)
    model.train(was_training)
    scored = batch.labels != IGNORE_INDEX
    return ((logits.argmax(-1) == batch.labels) | ~scored).all(1).float().mean().item()


@dataclass(frozen=True, slots=True)
class TrainResult:
    """``losses`` has one entry per step taken (fewer than ``spec.steps`` after an early stop);
    ``dev_exact_match``: the last development check, None without one."""

    losses: list[float]
    seconds: float
    tokens: int
    dev_exact_match: float | None = None
    abandoned: bool = False     # stopped on the plateau at spec.restart_after (see BootstrapSpec)
    attempts: int = 1


def train_policy(model: CausalLM, batches: Iterator[Batch], spec: BootstrapSpec,
                 log: Callable[[str], None] = print, log_every: int = 100,
                 dev: Batch | None = None, may_abandon: bool = False) -> TrainResult:
    """AdamW + warmup/cosine in fp32 for ``spec.steps`` steps; norms, biases and embeddings
    get no weight decay (the embedding is tied to lm_head). With ``dev`` (and
    ``spec.stop_at_short_accuracy`` > 0), every ``spec.check_every`` steps the exact-match rate
    on ``dev`` is measured and training stops once it reaches ``stop_at_short_accuracy``;
    with ``may_abandon``, also once it is still below ``restart_below`` at ``restart_after``."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=spec.lr, betas=(0.9, 0.98), eps=1e-8)
    model.train()
    losses: list[float] = []
    tokens = 0
    dev_acc: float | None = None
    check = dev is not None and spec.stop_at_short_accuracy > 0
    start = time.perf_counter()
    for step in range(spec.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec)
        batch = next(batches)
        loss = loss_on(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        losses.append(loss.item())
        tokens += int((batch.labels != IGNORE_INDEX).sum())
        if log_every and ((step + 1) % log_every == 0 or step + 1 == spec.steps):
            recent = losses[-log_every:]
            log(f"bootstrap step {step + 1}/{spec.steps} loss {sum(recent) / len(recent):.4f} "
                f"lr {lr_at(step, spec):.2e} {time.perf_counter() - start:.0f}s"
                + ("" if dev_acc is None else f" dev exact match {dev_acc:.3f}"))
        if check and (step + 1) % spec.check_every == 0:
            assert dev is not None
            dev_acc = exact_match_rate(model, dev)
            if dev_acc >= spec.stop_at_short_accuracy:
                log(f"bootstrap: stopping at step {step + 1}/{spec.steps}: dev exact match "
                    f"{dev_acc:.3f} >= {spec.stop_at_short_accuracy}")
                break
            if may_abandon and step + 1 >= spec.restart_after and dev_acc < spec.restart_below:
                log(f"bootstrap: dev exact match {dev_acc:.3f} < {spec.restart_below} at step "
                    f"{step + 1}: still on the plateau, restarting from a fresh init")
                model.eval()
                return TrainResult(losses, time.perf_counter() - start, tokens, dev_acc, True)
    model.eval()
    return TrainResult(losses, time.perf_counter() - start, tokens, dev_acc)


def heldout_problems(spec: BootstrapSpec, seed: int) -> list[Problem]:
    """The ``spec.num_heldout`` evaluation problems of ``seed``; training never sees them."""
    task, rng = get_task(spec.task), random.Random(f"fastdraft-bootstrap-heldout-{seed}")
    return [task.sample(rng) for _ in range(spec.num_heldout)]


def dev_problems(spec: BootstrapSpec, seed: int, tokenizer: _Encoder) -> list[Problem]:
    """``spec.num_dev`` short problems (at most ``spec.thin_above_tokens`` tokens, where the
    accuracy is learnt) for the early-stop check; training never sees them."""
    task, rng = get_task(spec.task), random.Random(f"fastdraft-bootstrap-dev-{seed}")
    out: list[Problem] = []
    while len(out) < spec.num_dev:
        problem = task.sample(rng)
        if len(encode_example(tokenizer, problem).input_ids) <= spec.thin_above_tokens:
            out.append(problem)
    return out


def train_bootstrap(spec: BootstrapSpec, seed: int, tokenizer: _Encoder,
                    log: Callable[[str], None] = print) -> tuple[CausalLM, TrainResult]:
    """Initialises and trains the policy of (spec, seed), skipping its held-out prompts.

    Deterministic: the same spec and seed give bit-identical weights on a machine, in any
    process and whatever the caller's RNG or thread settings (``determinism.py`` lists what
    is pinned, and what differs across CPUs)."""
    dev = dev_problems(spec, seed, tokenizer)
    exclude = frozenset(p.prompt for p in [*heldout_problems(spec, seed), *dev])
    dev_batch = collate([encode_example(tokenizer, p) for p in dev])
    losses: list[float] = []
    seconds, tokens = 0.0, 0
    with deterministic_cpu(spec.num_threads):
        for attempt in range(spec.max_attempts):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + attempt)
                model = CausalLM(model_config(spec))
                init_weights(model)
            log(f"bootstrap: training a {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-"
                f"param {spec.task} policy for up to {spec.steps} steps on {spec.num_threads} "
                f"threads" + (f" (attempt {attempt + 1})" if attempt else ""))
            batches = batch_stream(get_task(spec.task), tokenizer, spec,
                                   random.Random(f"fastdraft-bootstrap-{seed + attempt}"), exclude)
            trained = train_policy(model, batches, spec, log, dev=dev_batch,
                                   may_abandon=attempt + 1 < spec.max_attempts)
            losses += trained.losses
            seconds, tokens = seconds + trained.seconds, tokens + trained.tokens
            if not trained.abandoned:
                break
    return model, TrainResult(losses, seconds, tokens, trained.dev_exact_match,
                              attempts=attempt + 1)
