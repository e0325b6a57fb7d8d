"""The algorithm of a run: its advantage estimator and policy loss (registered by name in
rl/advantages.py and rl/policy_loss.py) with the recipe's options, and the loss as the actor
computes it micro-batch by micro-batch.

The loss normalises over the whole rollout batch (all its tokens, or all its sequences), so a
micro-batch contributes its own loss times its share of that normaliser: the sum over
micro-batches is exactly the batch loss, whatever the token budget."""

from __future__ import annotations

from typing import Any

import torch

from fastdraft.config.sections import AlgorithmConfig
from fastdraft.rl.actor import Objective, token_logprobs
from fastdraft.rl.advantages import compute_advantages, zero_variance_groups
from fastdraft.rl.policy_loss import PolicyBatch, policy_loss
from fastdraft.rl.sequences import SequenceBatch

DEFAULT_AGGREGATION = {"grpo": "seq-mean-token-mean", "dapo": "token-mean"}


class Algorithm:
    def __init__(self, cfg: AlgorithmConfig, temperature: float,
                 max_tokens: int | None = None) -> None:
        self.cfg, self.temperature = cfg, temperature
        self.aggregation = cfg.aggregation or DEFAULT_AGGREGATION.get(cfg.loss,
                                                                      "seq-mean-token-mean")
        options: dict[str, Any] = {"kl_coef": cfg.kl_coef, "aggregation": self.aggregation}
        if cfg.loss == "dapo":
            options.update(clip_low=cfg.clip_eps, clip_high=cfg.clip_high)
        else:
            options["clip_eps"] = cfg.clip_eps
        if self.aggregation == "seq-mean-token-sum-norm":
            options["max_tokens"] = max_tokens  # a constant: micro-batches differ in width
        self.options = options
        self.adv_options = {"scale_std": cfg.scale_std} if cfg.advantage == "grpo" else {}

    def advantages(self, rewards: list[float], group_size: int
                   ) -> tuple[list[float], list[float]]:
        """Per-sample advantages and sample weights (0 for groups skipped as zero-variance)."""
        r = torch.tensor(rewards, dtype=torch.float32)
        adv = compute_advantages(self.cfg.advantage, r, group_size, **self.adv_options)
        weight = torch.ones_like(r)
        if self.cfg.skip_zero_variance:
            weight = (~zero_variance_groups(r, group_size)).float().repeat_interleave(group_size)
        return adv.tolist(), weight.tolist()

    def objective(self, batch: SequenceBatch, reference: torch.nn.Module | None) -> Objective:
        total = self._normaliser(batch)

        def loss_of(logprobs: torch.Tensor, mb: SequenceBatch
                    ) -> tuple[torch.Tensor, dict[str, float]]:
            ref = None
            if reference is not None and self.cfg.kl_coef > 0:
                with torch.no_grad():
                    ref = token_logprobs(reference, mb.input_ids, self.temperature)
            loss, metrics = policy_loss(self.cfg.loss, PolicyBatch(
                logprobs=logprobs.float(), old_logprobs=mb.old_logprobs, advantages=mb.advantages,
                mask=mb.mask, ref_logprobs=ref, sample_weight=mb.sample_weight), **self.options)
            share = self._normaliser(mb) / total if total > 0 else 0.0
            return loss * share, {f"actor/{k}": v * share for k, v in metrics.items()}
        return loss_of

    def _normaliser(self, batch: SequenceBatch) -> float:
        """What the aggregation divides by: weighted tokens (token-mean) or sequences."""
        weight = batch.sample_weight.to(batch.mask.device)
        if self.aggregation == "token-mean":
            return float((batch.mask * weight[:, None]).sum())
        return float((weight * batch.mask.any(dim=1)).sum())
