"""Data-parallel drafter training among the members of a round (workers/trainer_group.py): every
member samples its own batch from its own buffer, the gradients are summed weighted by tokens
(so the step is the one a single trainer would take on all the members' batches together),
and every member takes the same optimizer step, so they stay identical. A round's members
agree before each micro-step whether to go on (a pause, or a newer round, ends it for all at
the same boundary) and start from the freshest member's state.

Only torch.distributed process-group calls (gloo on the host; a CUDA member's tensors go
through host memory), no Ray: a round is a ProcessGroup its members built over one store."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from fastdraft.trainer.spot import GradReduce, SpotTrainer


def _allreduce(pg: dist.ProcessGroup, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
    options = dist.AllreduceOptions()
    options.reduceOp = op
    pg.allreduce([tensor], options).wait()


def _broadcast(pg: dist.ProcessGroup, tensor: torch.Tensor, root: int) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = root
    pg.broadcast([tensor], options).wait()


def _on_host(tensors: list[torch.Tensor]) -> torch.Tensor:
    return _flatten_dense_tensors([t.detach().float().cpu() for t in tensors])


def token_weighted_grads(pg: dist.ProcessGroup) -> GradReduce:
    """SpotTrainer.step's reduce: each member's gradient times its tokens, summed, over the
    tokens of all (a member without a batch adds zeros and 0 tokens)."""

    def reduce(params: list[torch.nn.Parameter], tokens: int) -> bool:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = _on_host(grads) * tokens
        total = torch.tensor([float(tokens)])
        _allreduce(pg, total)
        if total.item() == 0:
            return False
        _allreduce(pg, flat)
        flat /= total
        for param, grad in zip(params, _unflatten_dense_tensors(flat, grads)):
            param.grad = grad.to(param.device, param.dtype)
        return True

    return reduce


def agree(pg: dist.ProcessGroup, stop: bool, newest_round: int) -> tuple[bool, int]:
    """Whether any member must stop, and the newest round any member was told of."""
    flags = torch.tensor([int(stop), newest_round], dtype=torch.int64)
    _allreduce(pg, flags, dist.ReduceOp.MAX)
    return bool(flags[0]), int(flags[1])


def sync_state(trainer: SpotTrainer, pg: dist.ProcessGroup, rank: int) -> int:
    """Every member takes the freshest member's drafter, optimizer moments and micro-step
    count (the one with the most steps; the lowest rank among equals), and the newest version
    any member published with its drafter (the serving one). Returns the rank it came from."""
    steps = torch.tensor([trainer.stats.steps], dtype=torch.int64)
    _allreduce(pg, steps, dist.ReduceOp.MAX)
    candidate = torch.tensor([rank if trainer.stats.steps == steps.item() else 1 << 30])
    _allreduce(pg, candidate, dist.ReduceOp.MIN)
    root = int(candidate.item())
    params = trainer.trainable()
    moments = _moments(trainer.optimizer, params)
    tensors = [*params, *moments]
    with torch.no_grad():
        flat = _on_host(tensors)
        _broadcast(pg, flat, root)
        for tensor, value in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
            tensor.copy_(value.to(tensor.device, tensor.dtype))
    _broadcast(pg, steps := torch.tensor([trainer.stats.steps], dtype=torch.int64), root)
    version = torch.tensor([trainer.version], dtype=torch.int64)
    _allreduce(pg, version, dist.ReduceOp.MAX)   # never a version twice
    # The engine serves the newest publisher's drafter: every member's held-out reference.
    holder = torch.tensor([rank if trainer.version == version.item() else 1 << 30])
    _allreduce(pg, holder, dist.ReduceOp.MIN)
    serving = _on_host(trainer.serving)
    _broadcast(pg, serving, int(holder.item()))
    trainer.serving = [t.clone() for t in _unflatten_dense_tensors(serving, trainer.serving)]
    trainer.stats.steps, trainer.version = int(steps.item()), int(version.item())
    return root


def _moments(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]
             ) -> list[torch.Tensor]:
    """AdamW's per-parameter state (step, exp_avg, exp_avg_sq), created as a first step would
    (zeros) where a member has not stepped yet, so every member has the same tensors."""
    out = []
    for param in params:
        state = optimizer.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        out += [state["step"], state["exp_avg"], state["exp_avg_sq"]]
    return out
