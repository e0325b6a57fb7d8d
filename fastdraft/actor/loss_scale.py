"""The dynamic loss scale of fp16 compute (torch.amp.GradScaler), with the skip decided by every
rank together.

GradScaler checks for inf/NaN in the gradients *this process* holds. A sharded actor's ranks hold
different shards, so one rank could see an overflow its peers do not, skip its step alone and
leave the shards out of step. Here the decision comes from the global gradient norm (all-reduced
by clip_grad_norm_): all ranks apply the step, or all skip it and shrink the scale. bf16 and
fp32 need no scale; the scaler is then a pass-through with the same interface.
"""

from __future__ import annotations

import math

import torch


class LossScaler:
    def __init__(self, compute_dtype: torch.dtype, device: torch.device,
                 init_scale: float = 2.0**16) -> None:
        self.enabled = compute_dtype == torch.float16
        self.scaler = torch.amp.GradScaler(device.type, init_scale=init_scale,
                                           enabled=self.enabled)

    @property
    def scale(self) -> float:
        return float(self.scaler.get_scale()) if self.enabled else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the gradients by the scale (before clipping reads their norm)."""
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, grad_norm: float) -> bool:
        """Applies the step when the global gradient norm is finite and not zero (a zero
        gradient, every sample skipped, steps nothing: Adam would still move the weights by its
        momentum); a non-finite norm skips it and shrinks the scale, on every rank alike.
        Returns whether the step was applied."""
        finite, apply = math.isfinite(grad_norm), math.isfinite(grad_norm) and grad_norm != 0
        if not self.enabled:
            if apply:
                optimizer.step()
            return apply
        if apply:
            self.scaler.step(optimizer)   # no local inf: a finite global norm excludes it
            self.scaler.update()
        else:   # new_scale also clears the unscale record of this step
            backoff = 1.0 if finite else self.scaler.get_backoff_factor()
            self.scaler.update(new_scale=self.scale * backoff)
        return apply

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.enabled else {}

    def load_state_dict(self, state: dict) -> None:
        if self.enabled and state:
            self.scaler.load_state_dict(state)
