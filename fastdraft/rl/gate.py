"""The lossless gate: every RL step, the actor recomputes the logprob of every sampled token and
compares it with the one the (speculative) engine reported. Speculation must never change what
is learned: a difference beyond what the dtype's rounding explains stops the run."""

from __future__ import annotations

import torch

# Max |actor - engine| per token that rounding explains: the engine's cached, packed, masked
# forward and the actor's plain causal one round differently (far more in half precision).
DEFAULT_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.05}


class LosslessGateError(ValueError):
    """The engine's logprobs are not the policy's: a speculation or weight-push bug. (A
    ValueError, so the CLI stops with its message rather than a traceback.)"""


def check_logprobs(actor: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor,
                   tolerance: float) -> dict[str, float]:
    """actor, engine [B, L - 1] logprobs, mask [B, L - 1] sampled tokens -> metrics; raises
    LosslessGateError when the largest difference exceeds `tolerance`."""
    diff = (actor - engine).abs()[mask]
    if not bool(torch.isfinite(diff).all()):
        raise LosslessGateError("non-finite logprobs in the lossless gate (actor or engine): "
                                "the policy's weights or the rollout are corrupt")
    worst = float(diff.max()) if diff.numel() else 0.0
    metrics = {"rollout/logprob_diff_max": worst,
               "rollout/logprob_diff_mean": float(diff.mean()) if diff.numel() else 0.0}
    if worst > tolerance:
        row, col = divmod(int((actor - engine).abs().masked_fill(~mask, 0).argmax()),
                          mask.shape[1])
        raise LosslessGateError(
            f"lossless gate: the engine's logprob of sample {row}'s token at column {col} "
            f"differs from the actor's by {worst:.3g} (> {tolerance:g}): the rollout was not "
            "sampled from the policy being trained. Check the weight push (engine.load_weights) "
            "and the speculative path (rollout.spec.method=none isolates it); raise "
            "algorithm.logprob_tolerance only if the dtype's rounding explains it")
    return metrics
