"""The synchronous half of a save: copy the TrainState to host memory, so the loop can go on
changing (or freeing) its tensors while the background writer puts the copy on disk."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fastdraft.checkpoint.layout import FORMAT
from fastdraft.checkpoint.sharded import ShardedActor
from fastdraft.checkpoint.state import TrainState
from fastdraft.checkpoint.tree import flatten
from fastdraft.errors import FastdraftError
from fastdraft.models import CausalLM, ModelConfig


class WeightSource(Protocol):
    """What a checkpoint reads its weights from: a CausalLM, or a sharded actor's gathering
    view of one (actor/sharding.Gathered)."""

    config: ModelConfig

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]: ...


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A host-memory copy of one TrainState, owned by the writer until its write completes."""

    step: int
    model: CausalLM | ShardedActor  # a CPU mirror of the actor (save_model), or its config:
    # the ranks wrote their shards (checkpoint/sharded.py)
    tensors: dict[str, torch.Tensor]
    state_json: str
    config_json: str


class HostMirror:
    """A CPU CausalLM with the actor's parameter names, shapes and dtypes, reused by every save.

    Reusing it is safe because a save waits for the previous write before copying again, and it
    keeps host memory at one copy of the weights. It is a real CausalLM so that save_model (the
    one HF writer) writes it; its rotary tables are never computed because it never runs. The
    source is read in one pass of `named_parameters()`: a sharded actor hands a view that
    gathers each full parameter as the pass reaches it (actor/sharding.Gathered).
    """

    def __init__(self) -> None:
        self._model: CausalLM | None = None

    def copy_from(self, model: WeightSource) -> CausalLM:
        if self._model is None or self._model.config != model.config:
            self._model = _empty(model.config)
        params = dict(self._model.named_parameters())
        with torch.no_grad():
            for name, src in model.named_parameters():
                dst = params[name]
                if dst.shape != src.shape or dst.dtype != src.dtype:   # first save, or changed
                    dst.data = torch.empty(src.shape, dtype=src.dtype, device="cpu",
                                           pin_memory=src.is_cuda)
                dst.copy_(src.detach())
        return self._model


def take_snapshot(step: int, state: TrainState, mirror: HostMirror) -> Snapshot:
    """Copies every tensor to host and serialises every plain value now, so a state that cannot
    be saved (a Path in the config, an unknown object in the optimizer state) fails here, in
    the caller, instead of later in the writer thread."""
    if step != state.step:
        raise FastdraftError(f"save(step={step}) was given a TrainState of step {state.step}")
    tensors: dict[str, torch.Tensor] = {}
    tree = {"format": FORMAT, "step": step,
            "optimizer": flatten(state.optimizer, "optimizer", tensors),
            "scheduler": flatten(state.scheduler, "scheduler", tensors),
            "rng": flatten(state.rng.as_tree(), "rng", tensors),
            "drafter": flatten(state.drafter, "drafter", tensors),
            "extra": _checked(state.extra, "extra")}
    sharded = isinstance(state.model, ShardedActor)
    if sharded:
        tree["actor"] = "dcp"   # the masters and optimizer state are in actor/, by rank
    return Snapshot(step=step, model=state.model if sharded else mirror.copy_from(state.model),
                    tensors=tensors,
                    state_json=json.dumps(tree), config_json=_dumps(state.config, "config"))


def _checked(obj: dict[str, Any], name: str) -> dict[str, Any]:
    # A JSON round trip also copies it: the loop may keep mutating its dict.
    return json.loads(_dumps(obj, name))


def _dumps(obj: dict[str, Any], name: str) -> str:
    try:
        return json.dumps(obj, indent=2, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise FastdraftError(f"TrainState.{name} must be JSON-serialisable ({e}): convert "
                             "dataclasses with dataclasses.asdict and paths with str") from e


def _empty(config: ModelConfig) -> CausalLM:
    """A CPU CausalLM whose parameters get their real storage at the first copy."""
    with torch.device("meta"):
        mirror = CausalLM(config, max_positions=1)
    mirror = mirror.to_empty(device="cpu")
    mirror.tie_weights()  # to_empty unties
    return mirror.requires_grad_(False)
