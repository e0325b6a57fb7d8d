"""Drafter training losses, pure functions over the policy's hidden states.

Alignment (EAGLE): the drafter input at index t is (features of token t, token t+1) and it is
scored against the policy at token t+1: its features f_{t+1} and its next-token distribution
softmax(lm_head(f_{t+1})) for token t+2. Shapes: B sequences of T tokens, H hidden, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastdraft.drafter.base import Drafter
from fastdraft.models import AttnMeta, HiddenStates

Metrics = dict[str, float]


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1)


def soft_ce(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """[..., V] x [..., V] -> [...]: cross-entropy against the policy's full distribution."""
    return -(target_probs * logits.float().log_softmax(-1)).sum(-1)


def eagle1_loss(drafter: Drafter, input_ids: torch.Tensor, hidden: HiddenStates,
                valid: torch.Tensor, lm_head: torch.nn.Module, weights: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, Metrics]:
    """input_ids [B, T], hidden.final [B, T, H], valid [B, T] bool (real tokens), weights [B]
    optional per-sample loss weights -> (1.0 * SmoothL1(f^, f) + 0.1 * soft-CE, metrics)."""
    f = hidden.final.detach()
    positions = torch.arange(1, input_ids.shape[1], device=input_ids.device).expand(
        input_ids.shape[0], -1)
    pred_f, logits = drafter.step(f[:, :-1], input_ids[:, 1:], positions)
    target_f = f[:, 1:]
    with torch.no_grad():
        target_probs = lm_head(target_f).float().softmax(-1)
    mask = (valid[:, 1:] & valid[:, :-1]).float()
    if weights is not None:
        mask = mask * weights.view(-1, 1)
    reg = F.smooth_l1_loss(pred_f.float(), target_f.float(), reduction="none").mean(-1)
    ce = soft_ce(logits, target_probs)
    loss = _masked_mean(reg, mask) + 0.1 * _masked_mean(ce, mask)
    top1 = _masked_mean((logits.argmax(-1) == target_probs.argmax(-1)).float(), mask.bool().float())
    return loss, {"loss": loss.item(), "regression": _masked_mean(reg, mask).item(),
                  "soft_ce": _masked_mean(ce, mask).item(), "top1_acc": top1.item()}


def ttt_mask(num_steps: int, length: int, device: torch.device) -> torch.Tensor:
    """[S*L, S*L] bool training-time-test mask (EAGLE-3): a query of step i at index t sees the
    real pairs 0..t of step 0 and its own drafted ancestors, index t of steps 1..i — exactly what
    a depth-(i+1) draft node sees at inference."""
    t = torch.arange(length, device=device)
    causal = t.view(-1, 1) >= t.view(1, -1)
    diagonal = torch.eye(length, dtype=torch.bool, device=device)
    mask = torch.zeros(num_steps * length, num_steps * length, dtype=torch.bool, device=device)
    for i in range(num_steps):
        rows = slice(i * length, (i + 1) * length)
        mask[rows, :length] = causal
        for j in range(1, i + 1):
            mask[rows, j * length: (j + 1) * length] = diagonal
    return mask


def eagle3_loss(drafter: Drafter, input_ids: torch.Tensor, hidden: HiddenStates,
                valid: torch.Tensor, lm_head: torch.nn.Module, weights: torch.Tensor | None = None,
                num_steps: int = 3) -> tuple[torch.Tensor, Metrics]:
    """Training-time test over num_steps: step j feeds the drafter its own step-(j-1) outputs and
    token t+1+j, scored by soft-CE against the policy at token t+1+j; loss = sum 0.8^j * CE_j.
    Each step re-runs the earlier steps' inputs (no cache: autograd-safe, k is small)."""
    batch, seq_len = input_ids.shape
    length = seq_len - 1
    feats = drafter.target_features(hidden)[:, :-1]
    final = hidden.final.detach()
    full_mask = ttt_mask(num_steps, length, input_ids.device)
    t = torch.arange(length, device=input_ids.device)
    inputs_h, inputs_ids, inputs_pos = [], [], []
    total = torch.zeros((), device=input_ids.device)
    metrics: Metrics = {}
    h = feats
    for j in range(num_steps):
        idx = (t + 1 + j).clamp_max(seq_len - 1)
        in_range = (t + 1 + j < seq_len).view(1, -1)
        inputs_h.append(h)
        inputs_ids.append(input_ids[:, idx])
        inputs_pos.append((t + 1 + j).expand(batch, -1))
        n = (j + 1) * length
        mask = full_mask[:n, :n].expand(batch, -1, -1)
        out, logits = drafter.step(torch.cat(inputs_h, 1), torch.cat(inputs_ids, 1),
                                   torch.cat(inputs_pos, 1), None, AttnMeta(mask))
        out, logits = out[:, -length:], logits[:, -length:]
        with torch.no_grad():
            target_probs = lm_head(final[:, idx]).float().softmax(-1)
        step_mask = (valid[:, idx] & in_range & valid[:, :-1]).float()
        if weights is not None:
            step_mask = step_mask * weights.view(-1, 1)
        ce = _masked_mean(soft_ce(logits, target_probs), step_mask)
        total = total + 0.8 ** j * ce
        acc = _masked_mean((logits.argmax(-1) == target_probs.argmax(-1)).float(),
                           step_mask.bool().float())
        metrics[f"soft_ce_{j}"], metrics[f"top1_acc_{j}"] = ce.item(), acc.item()
        h = out
    metrics["loss"], metrics["top1_acc"] = total.item(), metrics["top1_acc_0"]
    return total, metrics


def drafter_loss(drafter: Drafter, input_ids: torch.Tensor, hidden: HiddenStates,
                 valid: torch.Tensor, lm_head: torch.nn.Module,
                 weights: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """The loss of the drafter's kind (registered below)."""
    return LOSSES[drafter.kind](drafter, input_ids, hidden, valid, lm_head, weights)


LOSSES = {"eagle1": eagle1_loss, "eagle3": eagle3_loss}
