"""The actor: the policy being trained, the same CausalLM the engine runs (fastdraft/models),
optimised with AdamW through `accelerate` (mixed precision, DeepSpeed ZeRO when configured).

One `update` is one optimizer step over a whole rollout batch: micro-batches bounded by a token
budget, each contributing its share of the batch loss (the objective normalises over the whole
batch, so micro-batching never changes the gradient), then clipping and the step. A non-finite
loss or gradient skips the step (reported, nothing applied).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from accelerate import Accelerator

from fastdraft.config.sections import ActorConfig
from fastdraft.models import CausalLM
from fastdraft.rl.sequences import SequenceBatch, micro_batches
from fastdraft.utils.schedule import warmup_cosine_lr

# (logprobs [b, L - 1] of a micro-batch, the micro-batch) -> (its share of the batch loss,
# metrics summed over micro-batches, each already weighted by the share)
Objective = Callable[[torch.Tensor, SequenceBatch], tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True, slots=True)
class UpdateResult:
    applied: bool                  # False: a non-finite loss or gradient skipped the step
    metrics: dict[str, float]


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, temperature: float
                   ) -> torch.Tensor:
    """input_ids [B, L] -> log-softmax(logits / T) of each next token [B, L - 1] (column t is
    token t + 1 given tokens 0..t): the quantity the engine reports per sampled token."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    logits, _ = model(input_ids, positions)
    logits = logits[:, :-1].float() / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)
    return logits.gather(-1, targets).squeeze(-1) - logits.logsumexp(-1)


class Actor:
    def __init__(self, model: CausalLM, cfg: ActorConfig, total_steps: int) -> None:
        self.cfg, self.total_steps = cfg, total_steps
        mixed = {"float32": "no", "bfloat16": "bf16", "float16": "fp16"}[cfg.compute_dtype]
        device = next(model.parameters()).device
        self.accelerator = Accelerator(mixed_precision=mixed, cpu=device.type == "cpu")
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas,
                                      weight_decay=cfg.weight_decay)
        self.model, self.optimizer = self.accelerator.prepare(model.train(), optimizer)
        self.step = 0

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def unwrapped(self) -> CausalLM:
        return self.accelerator.unwrap_model(self.model)

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named weights (what `engine.load_weights` takes)."""
        return self.unwrapped().named_parameters()

    @torch.no_grad()
    def logprobs(self, batch: SequenceBatch, temperature: float) -> torch.Tensor:
        """The actor's logprobs of every token of the batch [B, L - 1] (no gradient), computed
        in micro-batches: the lossless gate compares them with the engine's."""
        out = torch.zeros(batch.mask.shape)
        for index in micro_batches(batch, self.cfg.micro_batch_tokens):
            mb = batch.rows(index)
            lp = token_logprobs(self.model, mb.input_ids.to(self.device), temperature)
            out[index, : lp.shape[1]] = lp.float().cpu()
        return out

    def update(self, batch: SequenceBatch, objective: Objective, temperature: float,
               before_step: Callable[[torch.Tensor], None] | None = None) -> UpdateResult:
        """One optimizer step over the batch. before_step receives the actor's logprobs of the
        whole batch [B, L - 1] (detached, from the very forward the gradient comes from) after
        the backward passes and before the step: the lossless gate checks them there, so it
        costs no extra forward, and an exception from it leaves the weights untouched."""
        lr = warmup_cosine_lr(self.step, lr=self.cfg.lr, warmup_steps=self.cfg.warmup_steps,
                              total_steps=self.total_steps, min_ratio=1.0)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, float] = {}
        finite = True
        seen = torch.zeros(batch.mask.shape)
        for index in micro_batches(batch, self.cfg.micro_batch_tokens):
            mb = batch.rows(index).to(self.device)
            with self.accelerator.autocast():
                logprobs = token_logprobs(self.model, mb.input_ids, temperature)
            seen[index, : logprobs.shape[1]] = logprobs.detach().float().cpu()
            loss, mb_metrics = objective(logprobs, mb)
            if not torch.isfinite(loss):
                finite = False
                break
            self.accelerator.backward(loss)
            for key, value in mb_metrics.items():
                metrics[key] = metrics.get(key, 0.0) + value
        if before_step is not None:
            try:
                before_step(seen)
            except BaseException:
                self.optimizer.zero_grad(set_to_none=True)
                raise
        grad_norm = math.nan
        if finite:
            grad_norm = float(self.accelerator.clip_grad_norm_(self.model.parameters(),
                                                                self.cfg.grad_clip))
            finite = math.isfinite(grad_norm)
        # A zero gradient (every sample skipped) steps nothing: Adam would still move the
        # weights by its momentum.
        if finite and grad_norm > 0:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        metrics.update({"actor/grad_norm": grad_norm, "actor/lr": lr,
                        "actor/skipped": 0.0 if finite else 1.0})
        return UpdateResult(finite, metrics)
