"""Drafter training losses, pure functions over the policy's hidden states.

Alignment (EAGLE): the drafter input at index t is (features of token t, token t+1) and it is
scored against the policy at token t+1: its features f_{t+1} and its next-token distribution
softmax(lm_head(f_{t+1})) for token t+2. Shapes: B sequences of T tokens, H hidden, V vocab.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastdraft.drafter.base import Drafter
from fastdraft.models import AttnMeta, HiddenStates

Metrics = dict[str, float]

#: Unrolled training steps per drafter kind when the caller does not say. EAGLE-1 trains two
#: (HASS-style: the second step feeds the drafter its own features, as tree levels past the first
#: do); on the bootstrap policy that lifted greedy acceptance from 5.57 / 5.11 (two warm-up seeds)
#: to 5.68 / 5.71 (counted then with accepted nodes past an answer's end, so higher than today's
#: figures; the order held in speedup). EAGLE-3's training-time test uses three.
DEFAULT_NUM_STEPS = {"eagle1": 2, "eagle3": 3}


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1)


def soft_ce(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """[..., V] x [..., V] -> [...]: cross-entropy against the policy's full distribution."""
    return -(target_probs * logits.float().log_softmax(-1)).sum(-1)


def ce_target(policy_probs: torch.Tensor, argmax_weight: float) -> torch.Tensor:
    """[..., V] -> [..., V]: (1 - w) * p + w * onehot(argmax p). Greedy verification accepts a
    draft only where it IS the policy's argmax, so where p is nearly flat between two tokens the
    drafter must still rank them as the policy does; the one-hot share widens that margin.
    Sampled verification wants q close to p, so w trades sampled for greedy acceptance."""
    if argmax_weight == 0.0:
        return policy_probs
    hard = F.one_hot(policy_probs.argmax(-1), policy_probs.shape[-1]).to(policy_probs.dtype)
    return torch.lerp(policy_probs, hard, argmax_weight)


def eagle1_loss(drafter: Drafter, input_ids: torch.Tensor, hidden: HiddenStates,
                valid: torch.Tensor, lm_head: torch.nn.Module, weights: torch.Tensor | None = None,
                num_steps: int = DEFAULT_NUM_STEPS["eagle1"], argmax_weight: float = 0.0,
                **packing: torch.Tensor | None) -> tuple[torch.Tensor, Metrics]:
    """EAGLE-1: 1.0 * SmoothL1(f^, f) + 0.1 * soft-CE per step. num_steps > 1 adds HASS-style
    unrolled steps (the drafter's own features fed back), which is what deeper draft levels see;
    num_steps = 1 is classic EAGLE-1."""
    return unrolled_loss(drafter, input_ids, hidden, valid, lm_head, weights, num_steps,
                         regression_weight=1.0, ce_weight=0.1, argmax_weight=argmax_weight,
                         **packing)


def eagle3_loss(drafter: Drafter, input_ids: torch.Tensor, hidden: HiddenStates,
                valid: torch.Tensor, lm_head: torch.nn.Module, weights: torch.Tensor | None = None,
                num_steps: int = DEFAULT_NUM_STEPS["eagle3"], argmax_weight: float = 0.0,
                **packing: torch.Tensor | None) -> tuple[torch.Tensor, Metrics]:
    """EAGLE-3: soft-CE only, with a training-time test over num_steps."""
    return unrolled_loss(drafter, input_ids, hidden, valid, lm_head, weights, num_steps,
                         regression_weight=0.0, ce_weight=1.0, argmax_weight=argmax_weight,
                         **packing)


def ttt_mask(num_steps: int, length: int, device: torch.device,
             segments: torch.Tensor | None = None) -> torch.Tensor:
    """[S*L, S*L] bool training-time-test mask (EAGLE-3): a query of step i at index t sees the
    real pairs 0..t of step 0 and its own drafted ancestors, index t of steps 1..i — exactly what
    a depth-(i+1) draft node sees at inference. segments [B, L] (packed sequences: which
    sequence each index belongs to) -> [B, S*L, S*L], step 0's pairs seen only within a
    sequence (block-diagonal)."""
    t = torch.arange(length, device=device)
    causal = t.view(-1, 1) >= t.view(1, -1)
    if segments is not None:
        causal = causal & (segments.unsqueeze(2) == segments.unsqueeze(1))
    diagonal = torch.eye(length, dtype=torch.bool, device=device)
    mask = torch.zeros(*causal.shape[:-2], num_steps * length, num_steps * length,
                       dtype=torch.bool, device=device)
    for i in range(num_steps):
        rows = slice(i * length, (i + 1) * length)
        mask[..., rows, :length] = causal
        for j in range(1, i + 1):
            mask[..., rows, j * length: (j + 1) * length] = diagonal
    return mask


@dataclass(frozen=True, slots=True)
class UnrolledStep:
    """Step j of the training-time test, over the L = T - 1 pair indices t: the drafter's
    features `out` [B, L, H] and logits [B, L, V] for token t+1+j, the policy's features
    `target_f` and next-token distribution `target_probs` there (no gradient), and `scored`
    [B, L] bool: the pairs that may be scored (answer tokens, target inside the sequence)."""

    j: int
    out: torch.Tensor
    logits: torch.Tensor
    target_f: torch.Tensor
    target_probs: torch.Tensor
    scored: torch.Tensor


def unrolled_steps(drafter: Drafter, input_ids: torch.Tensor, hidden: HiddenStates,
                   valid: torch.Tensor, lm_head: torch.nn.Module, num_steps: int,
                   segments: torch.Tensor | None = None,
                   positions: torch.Tensor | None = None) -> Iterator[UnrolledStep]:
    """The training-time test (EAGLE-3, HASS), one step at a time: step j feeds the drafter its
    own step-(j-1) outputs and token t+1+j, and is scored against the policy at token t+1+j, so
    pair index t of step j is what the depth-(j+1) node of a chain drafted from t sees at
    inference. input_ids [B, T], hidden [B, T, H], valid [B, T] bool (tokens that may be
    scored). Packed rows (several sequences one after the other): segments [B, T] numbers each
    token's sequence and positions [B, T] restart at 0 in each; a pair never spans two
    sequences and attention stays within one. Each step re-runs the earlier steps' inputs (no
    cache: autograd-safe, num_steps is small)."""
    batch, seq_len = input_ids.shape
    length = seq_len - 1
    feats = drafter.target_features(hidden)[:, :-1]
    final = hidden.final.detach()
    in_rows = None if segments is None else segments[:, :-1]
    full_mask = (ttt_mask(num_steps, length, input_ids.device, in_rows)
                 if num_steps > 1 or segments is not None else None)
    if full_mask is not None and full_mask.dim() == 2:
        full_mask = full_mask.expand(batch, -1, -1)
    t = torch.arange(length, device=input_ids.device)
    inputs_h, inputs_ids, inputs_pos = [], [], []
    h = feats
    for j in range(num_steps):
        idx = (t + 1 + j).clamp_max(seq_len - 1)
        in_range = (t + 1 + j < seq_len).view(1, -1)
        if segments is not None:  # the pair's target lies in the same sequence
            in_range = in_range & (segments[:, idx] == in_rows)
        inputs_h.append(h)
        inputs_ids.append(input_ids[:, idx])
        inputs_pos.append((t + 1 + j).expand(batch, -1) if positions is None
                          else positions[:, idx])
        n = (j + 1) * length
        attn = None if full_mask is None else AttnMeta(full_mask[:, :n, :n])
        out, logits = drafter.step(torch.cat(inputs_h, 1), torch.cat(inputs_ids, 1),
                                   torch.cat(inputs_pos, 1), None, attn)
        out, logits = out[:, -length:], logits[:, -length:]
        target_f = final[:, idx]
        with torch.no_grad():
            target_probs = drafter.head_probs(lm_head(target_f).float().softmax(-1))
        yield UnrolledStep(j, out, logits, target_f, target_probs,
                           valid[:, idx] & in_range & valid[:, :-1])
        h = out


def unrolled_loss(drafter: Drafter, input_ids: torch.Tensor, hidden: HiddenStates,
                  valid: torch.Tensor, lm_head: torch.nn.Module, weights: torch.Tensor | None,
                  num_steps: int, regression_weight: float, ce_weight: float,
                  argmax_weight: float = 0.0, segments: torch.Tensor | None = None,
                  positions: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """Training-time test over num_steps (`unrolled_steps`): loss = sum_j 0.8^j *
    (regression_weight * SmoothL1_j + ce_weight * CE_j), SmoothL1 of the drafter's features
    against the policy's (when regression_weight > 0), CE of its next-token distribution
    against ce_target(p, argmax_weight). weights [B] per-sample or [B, T] per-token (at the
    pair's first token) optional weights. Packed rows give the loss of the same sequences
    padded into rows of their own. Metrics per step j: soft_ce_j, kl_j (KL(p || q) against the
    policy's own p), top1_acc_j, top3_acc_j (the policy's argmax among the drafter's 3 most
    likely tokens)."""
    length = input_ids.shape[1] - 1
    if weights is not None and weights.dim() == 1:
        weights = weights.view(-1, 1)
    total = torch.zeros((), device=input_ids.device)
    metrics: Metrics = {}
    for s in unrolled_steps(drafter, input_ids, hidden, valid, lm_head, num_steps, segments,
                            positions):
        j, logits, target_probs = s.j, s.logits, s.target_probs
        step_mask = s.scored.float()
        if weights is not None:
            step_mask = step_mask * weights[:, : length] if weights.shape[1] > 1 else (
                step_mask * weights)
        ce = _masked_mean(soft_ce(logits, ce_target(target_probs, argmax_weight)), step_mask)
        step_loss = ce_weight * ce
        if regression_weight > 0:
            reg = _masked_mean(F.smooth_l1_loss(s.out.float(), s.target_f.float(),
                                                reduction="none").mean(-1), step_mask)
            step_loss = step_loss + regression_weight * reg
            metrics[f"regression_{j}"] = reg.item()
        total = total + 0.8 ** j * step_loss
        scored = step_mask.bool().float()
        target_ids = target_probs.argmax(-1, keepdim=True)
        top3 = logits.topk(min(3, logits.shape[-1]), -1).indices
        with torch.no_grad():
            entropy = -(target_probs * target_probs.clamp_min(1e-30).log()).sum(-1)
            kl = _masked_mean(soft_ce(logits, target_probs) - entropy, step_mask)
        metrics[f"soft_ce_{j}"], metrics[f"kl_{j}"] = ce.item(), kl.item()
        metrics[f"top1_acc_{j}"] = _masked_mean((top3[..., :1] == target_ids).squeeze(-1)
                                                .float(), scored).item()
        metrics[f"top3_acc_{j}"] = _masked_mean((top3 == target_ids).any(-1).float(),
                                                scored).item()
    metrics["loss"], metrics["top1_acc"] = total.item(), metrics["top1_acc_0"]
    metrics["top3_acc"] = metrics["top3_acc_0"]
    return total, metrics


def drafter_loss(drafter: Drafter, input_ids: torch.Tensor, hidden: HiddenStates,
                 valid: torch.Tensor, lm_head: torch.nn.Module,
                 weights: torch.Tensor | None = None, num_steps: int | None = None,
                 argmax_weight: float = 0.0) -> tuple[torch.Tensor, Metrics]:
    """The loss of the drafter's kind (registered below); num_steps None = the kind's default."""
    num_steps = DEFAULT_NUM_STEPS[drafter.kind] if num_steps is None else num_steps
    return LOSSES[drafter.kind](drafter, input_ids, hidden, valid, lm_head, weights,
                                num_steps=num_steps, argmax_weight=argmax_weight)


LOSSES = {"eagle1": eagle1_loss, "eagle3": eagle3_loss}
