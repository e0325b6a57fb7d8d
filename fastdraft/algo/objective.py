"""The algorithm of a run: its advantage estimator and policy loss (registered by name in
algo/advantages.py and algo/policy_loss.py) with the recipe's options resolved, and the loss as the
actor computes it micro-batch by micro-batch.

The loss normalises over the whole rollout batch (all its tokens, or all its sequences), so a
micro-batch contributes its own loss times its share of that normaliser: the sum over
micro-batches is exactly the batch loss, whatever the token budget or the rank it runs on.

A sequence with a non-finite value (the engine's old logprob, the actor's logprob, the
reference's, or its advantage) is skipped: its weight becomes 0 and it is counted in
`actor/skipped_sequences`; the step goes on with the others, and the actor never sees an
exception. The engine's side is known before any forward, so `normaliser` leaves such a
sequence out of the batch's normaliser too; one the actor's own forward makes non-finite is
known only in its micro-batch, so it adds 0 to a normaliser that still counts it (the batch
loss shrinks by its share). A micro-batch with nothing finite left contributes a zero loss; when
that is every micro-batch, the gradient is zero and the actor skips the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fastdraft.algo.advantages import (
    advantage_aggregation,
    compute_advantages,
    zero_variance_groups,
)
from fastdraft.algo.logprobs import Objective
from fastdraft.algo.overlong import shape_overlong
from fastdraft.algo.policy_loss import (
    PolicyBatch,
    finite_sequences,
    policy_loss,
    policy_loss_defaults,
)
from fastdraft.algo.sequences import SequenceBatch
from fastdraft.config.sections import AlgorithmConfig
from fastdraft.errors import FastdraftError


class Algorithm:
    def __init__(self, cfg: AlgorithmConfig, temperature: float,
                 max_tokens: int | None = None) -> None:
        self.cfg, self.temperature, self.max_tokens = cfg, temperature, max_tokens
        takes = policy_loss_defaults(cfg.loss)
        # An unset option keeps the registered function's own default (clip_high 0.28 under
        # dapo, scale_std true under grpo); AlgorithmConfig refused options that do nothing.
        self.aggregation: str = (cfg.aggregation or advantage_aggregation(cfg.advantage)
                                 or takes["aggregation"])
        options: dict[str, Any] = {"kl_coef": cfg.kl_coef, "aggregation": self.aggregation}
        options["clip_low" if "clip_low" in takes else "clip_eps"] = cfg.clip_eps
        if cfg.clip_high is not None:
            options["clip_high"] = cfg.clip_high
        if self.aggregation == "seq-mean-token-sum-norm":
            options["max_tokens"] = max_tokens  # a constant: micro-batches differ in width
        self.options = options
        self.adv_options = {} if cfg.scale_std is None else {"scale_std": cfg.scale_std}

    def advantages(self, rewards: list[float], group_size: int,
                   lengths: list[int] | None = None, truncated: list[bool] | None = None
                   ) -> tuple[list[float], list[float]]:
        """Per-sample advantages and sample weights (0 for groups skipped as zero-variance,
        and with algorithm.overlong_filter for answers cut at the budget). lengths / truncated:
        each answer's tokens and whether the budget cut it (DAPO's overlong shaping,
        algo/overlong.py; needed when the algorithm shapes)."""
        cfg, kept = self.cfg, [1.0] * len(rewards)
        if cfg.overlong_buffer or cfg.overlong_filter:
            if lengths is None or truncated is None or self.max_tokens is None:
                raise FastdraftError("overlong shaping needs the answers' lengths, whether "
                                     "they were cut, and the budget (max_tokens)")
            rewards, kept = shape_overlong(rewards, lengths, truncated, self.max_tokens,
                                           cfg.overlong_buffer, cfg.overlong_filter)
        r = torch.tensor(rewards, dtype=torch.float32)
        adv = compute_advantages(cfg.advantage, r, group_size, **self.adv_options)
        weight = torch.tensor(kept)
        if cfg.skip_zero_variance:
            weight *= (~zero_variance_groups(r, group_size)).float().repeat_interleave(group_size)
        return adv.tolist(), weight.tolist()

    def objective(self, batch: SequenceBatch | None,
                  reference: Callable[[SequenceBatch], torch.Tensor] | None,
                  total: float | None = None) -> Objective:
        """The loss of a micro-batch as its share of the batch loss. reference: the frozen
        reference's logprobs of a micro-batch [b, L - 1] (the KL term's). total: the whole batch's
        `normaliser` (a rank that sees only some micro-batches is given it); None: `batch`'s.
        Metrics are shares too (they sum to the batch's over micro-batches), except
        actor/skipped_sequences, a count."""
        if total is None:
            if batch is None:
                raise FastdraftError("objective() needs the batch or its normaliser (total=)")
            total = self.normaliser(batch)

        def loss_of(logprobs: torch.Tensor, mb: SequenceBatch
                    ) -> tuple[torch.Tensor, dict[str, float]]:
            ref = None
            if reference is not None and self.cfg.kl_coef > 0:
                with torch.no_grad():
                    ref = reference(mb)
            finite = finite_sequences(mb.mask, mb.advantages, logprobs, mb.old_logprobs, ref)
            skipped = float((~finite & mb.mask.any(dim=1)).sum())
            mask = mb.mask & finite.unsqueeze(1)   # a skipped sequence scores no token
            loss, metrics = policy_loss(self.cfg.loss, PolicyBatch(
                logprobs=logprobs.float(), old_logprobs=mb.old_logprobs,
                advantages=torch.where(finite, mb.advantages, 0.0), mask=mask,
                ref_logprobs=ref, sample_weight=mb.sample_weight), **self.options)
            share = self._weight(mask, mb.sample_weight) / total if total > 0 else 0.0
            return loss * share, {**{f"actor/{k}": v * share for k, v in metrics.items()},
                                  "actor/skipped_sequences": skipped}
        return loss_of

    def normaliser(self, batch: SequenceBatch) -> float:
        """What the batch loss divides by: its weighted answer tokens (token-mean) or weighted
        sequences (the seq-mean modes), over sequences whose engine-side values (old logprobs,
        advantage) are finite. A sharded actor computes it once on the whole batch and passes
        it to every rank's `objective(None, reference, total=...)`."""
        finite = finite_sequences(batch.mask, batch.advantages, batch.old_logprobs)
        return self._weight(batch.mask & finite.unsqueeze(1), batch.sample_weight)

    def _weight(self, mask: torch.Tensor, sample_weight: torch.Tensor) -> float:
        weight = sample_weight.to(mask.device)
        if self.aggregation == "token-mean":
            return float((mask * weight[:, None]).sum())
        return float((weight * mask.any(dim=1)).sum())
