"""What a training checkpoint holds (TrainState), what loading gives back (LoadedState), and the
random-number-generator states that make a resumed run draw the same numbers as an unbroken one."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastdraft.checkpoint.sharded import ShardedActor
from fastdraft.errors import FastdraftError
from fastdraft.models import CausalLM, ModelConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class RngState:
    """Global generator states: python `random`, numpy's legacy global generator, torch CPU and
    every CUDA device (empty where this process has not initialised CUDA: a CPU-only machine,
    or a driver whose devices are its workers'). Sampling, shuffling and dropout draw from
    these, so restoring them is what makes a resumed run continue like an unbroken one.

    A process that never initialised CUDA drew nothing from its CUDA generators (they hold
    their seeds), so it has no CUDA state to keep; reading one would create a CUDA context on
    every visible device (~0.5 GB each), memory its workers' plans count on."""

    python: tuple
    numpy: tuple
    torch_cpu: torch.Tensor
    torch_cuda: tuple[torch.Tensor, ...] = ()

    @classmethod
    def capture(cls) -> RngState:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else ()
        return cls(python=random.getstate(),
                   numpy=(kind, tuple(keys.tolist()), pos, has_gauss, gauss),
                   torch_cpu=torch.get_rng_state(), torch_cuda=cuda)

    def restore(self) -> None:
        random.setstate(self.python)
        kind, keys, pos, has_gauss, gauss = self.numpy
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
        torch.set_rng_state(self.torch_cpu)
        if not self.torch_cuda or not torch.cuda.is_available():
            return
        if len(self.torch_cuda) != torch.cuda.device_count():
            raise FastdraftError(f"the checkpoint has CUDA RNG states for {len(self.torch_cuda)} "
                                 f"devices, this process sees {torch.cuda.device_count()}: resume "
                                 "with the same CUDA_VISIBLE_DEVICES as the run that saved it")
        torch.cuda.set_rng_state_all(list(self.torch_cuda))

    def as_tree(self) -> dict[str, Any]:
        return {"python": self.python, "numpy": self.numpy, "torch_cpu": self.torch_cpu,
                "torch_cuda": self.torch_cuda}

    @classmethod
    def from_tree(cls, tree: dict[str, Any]) -> RngState:
        return cls(python=tree["python"], numpy=tree["numpy"], torch_cpu=tree["torch_cpu"],
                   torch_cuda=tuple(tree["torch_cuda"]))


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainState:
    """Everything the GRPO loop needs to resume at `step`.

    model: the actor (saved as an HF checkpoint directory, so any HF tool can read it), or a
    ShardedActor: its ranks wrote the masters and optimizer state (checkpoint/sharded.py).
    optimizer / scheduler: their `state_dict()`s (scheduler optional).
    rng: captured when this TrainState is built, i.e. at the checkpoint point of the loop.
    config: the run's config (JSON); extra: small JSON-able bookkeeping (e.g. metrics cursor).
    drafter: the drafter's selective state (its trainable tensors and version; no policy
    tensors), a tree with tensor leaves like the optimizer's, or None.
    """

    model: CausalLM | ShardedActor
    optimizer: dict[str, Any]
    step: int
    scheduler: dict[str, Any] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    drafter: dict[str, Any] | None = None
    rng: RngState = field(default_factory=RngState.capture)

    def __post_init__(self) -> None:
        if not isinstance(self.step, int) or self.step < 0:
            raise FastdraftError(f"TrainState.step must be an int >= 0, got {self.step!r}")
        if not isinstance(getattr(self.model, "config", None), ModelConfig):
            raise FastdraftError(f"TrainState.model must be a fastdraft CausalLM (saved in HF "
                                 f"format), got {type(self.model).__name__}")
        for name in ("optimizer", "config", "extra"):
            if not isinstance(getattr(self, name), dict):
                raise FastdraftError(f"TrainState.{name} must be a dict, got "
                                     f"{type(getattr(self, name)).__name__}")


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadedState:
    """What `load` returns besides restoring model, optimizer, scheduler and RNG in place."""

    path: Path
    step: int
    config: dict[str, Any]
    extra: dict[str, Any]
    drafter: dict[str, Any] | None = None
    optimizer: dict[str, Any] | None = None   # None in a sharded checkpoint: load_shards
    scheduler: dict[str, Any] | None = None
    sharded: bool = False   # the actor's masters and optimizer state are in actor/ (DCP)
