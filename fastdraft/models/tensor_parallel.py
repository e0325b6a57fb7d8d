"""Tensor parallelism (Megatron's layout) for the one decoder: a replica of the policy spans k
ranks, each holding 1/k of every layer.

Column-parallel q/k/v and gate/up (each rank computes its heads and its slice of the MLP's
intermediate features), row-parallel o and down (each rank multiplies its slice of the input
features; one all-reduce sums the k partial outputs, then the bias is added once). The
embedding, the norms and the head are replicated, so every rank ends a forward with the same
hidden states and the same logits: sampling, speculation and acceptance decide the same tokens on
every rank from the same per-request random streams, and the drafter runs replicated.

A rank's model is a CausalLM built from `shard_config` (1/k of the heads, KV heads and MLP
features): its KV cache, memory plan and attention are those of a model that size. Full tensors
(a checkpoint, an actor's gathered update) cross by `local_tensor`, which slices them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fastdraft.errors import FastdraftError
from fastdraft.models.config import ModelConfig

# Parameter name suffixes -> the dimension their full tensor is split along (others replicate).
_COLUMN = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight",
           "v_proj.bias", "gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias")
_ROW = ("o_proj.weight", "down_proj.weight")


@dataclass(frozen=True)
class TPRank:
    """This process's place in a tensor-parallel replica: rank `rank` of `size`. ranks: the
    replica's ranks in the default process group (None: the default group is the replica).
    The replica's group is made at its first collective, by its members alone: an engine is
    built before the workers' process group exists."""

    rank: int
    size: int
    ranks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise FastdraftError(f"tensor-parallel rank {self.rank} is not in 0..{self.size - 1}")
        if self.ranks is not None and len(self.ranks) != self.size:
            raise ValueError(f"a replica of {self.size} ranks named {len(self.ranks)}")

    @property
    def group(self) -> dist.ProcessGroup | None:
        if self.ranks is None:
            return None
        if self.ranks not in _GROUPS:
            _GROUPS[self.ranks] = dist.new_group(list(self.ranks),
                                                 use_local_synchronization=True)
        return _GROUPS[self.ranks]


_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}   # replica ranks -> its process group


def replica_of(rank: int, size: int) -> TPRank:
    """Worker `rank`'s place when consecutive workers form replicas of `size`."""
    first = rank - rank % size
    return TPRank(rank % size, size, tuple(range(first, first + size)))


_SPLIT = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def tensor_parallel_sizes(cfg: ModelConfig, most: int) -> list[int]:
    """The replica sizes up to `most` that split this model evenly."""
    return [k for k in range(1, most + 1) if all(getattr(cfg, n) % k == 0 for n in _SPLIT)]


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """A replica of k ranks splits the heads, the KV heads and the MLP's features evenly;
    KV heads are split, never replicated (k must divide them)."""
    if size < 1:
        raise FastdraftError(f"rollout.tensor_parallel must be >= 1, got {size}")
    for name in _SPLIT:
        value = getattr(cfg, name)
        if value % size:
            raise FastdraftError(
                f"rollout.tensor_parallel={size} does not divide the policy's {name} ({value}); "
                f"tensor parallelism splits KV heads (it does not replicate them): use one of "
                f"{tensor_parallel_sizes(cfg, max(size, cfg.num_key_value_heads))}")


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config of one rank's slice of the model."""
    check_tensor_parallel(cfg, size)
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // size,
                               num_key_value_heads=cfg.num_key_value_heads // size,
                               intermediate_size=cfg.intermediate_size // size)


def split_dim(name: str) -> int | None:
    """The dimension a full tensor of this name is split along across ranks (None: replicated)."""
    if name.endswith(_COLUMN):
        return 0
    if name.endswith(_ROW):
        return 1
    return None


def local_tensor(tp: TPRank | None, name: str, full: torch.Tensor) -> torch.Tensor:
    """Rank tp.rank's slice of the full tensor `name` (a view: nothing is copied here)."""
    dim = None if tp is None or tp.size == 1 else split_dim(name)
    if dim is None:
        return full
    if full.shape[dim] % tp.size:
        raise FastdraftError(f"weight {name!r} of shape {tuple(full.shape)} does not split "
                             f"into {tp.size} tensor-parallel slices along dim {dim}")
    return full.chunk(tp.size, dim)[tp.rank]


def local_tensors(tp: TPRank | None, named: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, full in named:
        yield name, local_tensor(tp, name, full)


class RowParallelLinear(nn.Linear):
    """A linear over this rank's slice of the input features: the partial products of the k
    ranks summed by one all-reduce, then the (replicated) bias added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPRank) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out, group=self.tp.group)
        return out if self.bias is None else out + self.bias


def use_row_parallel(layers: Iterable[nn.Module], tp: TPRank) -> None:
    """Makes the o and down projections of decoder layers built from shard_config row-parallel
    (same parameter names and shapes)."""
    for layer in layers:
        for owner, attr in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            linear = getattr(owner, attr)
            row = RowParallelLinear(linear.in_features, linear.out_features,
                                    linear.bias is not None, tp)
            row.weight, row.bias = linear.weight, linear.bias
            setattr(owner, attr, row)
