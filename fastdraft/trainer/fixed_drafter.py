"""The drafter as the engine holds it, across checkpoints (its trainable tensors and version,
what --resume puts back), and FixedDrafter: the loop's drafter side when the drafter is not
trained online (the health check, checkpointed like the online one's)."""

from __future__ import annotations

from typing import Any

from fastdraft.drafter.checkpoint import trainable_named_tensors
from fastdraft.engine import Completion
from fastdraft.engine.rollout import Rollout
from fastdraft.trainer.drafter_health import DrafterHealth


class FixedDrafter:
    """The loop's drafter side when the drafter is not trained online: the health check."""

    on_hidden = None
    actor_hidden_layers = None   # nothing asks the actor's forward for samples

    def __init__(self, engine: Rollout | None = None, resume: dict | None = None) -> None:
        self.health = DrafterHealth()
        self.engine = engine
        self.version = None if engine is None else engine.drafter_version
        if engine is not None and resume:
            self.version = load_engine_drafter(engine, resume, self.version)
            self.health.load_state_dict(resume.get("health"), engine)

    def start_rollout(self, step: int, num_requests: int, engine: Rollout) -> None: ...
    def on_finish(self, completion: Completion) -> None: ...
    def end_rollout(self, rewards: list[float]) -> None: ...
    def start_update(self) -> None: ...
    def end_update(self) -> None: ...
    def close(self, timeout_s: float = 30.0) -> None: ...

    def trainer_state(self) -> dict | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        if self.engine is None:
            return {}
        return {**engine_drafter_state(self.engine, self.version),
                "health": self.health.state_dict()}

    def after_step(self, engine: Rollout, accept_length: float | None
                   ) -> dict[str, float]:
        self.health.observe(engine, accept_length)
        return {"drafter/fallback": 1.0} if self.health.fallback else {}


def engine_drafter_state(engine: Rollout, version: int | None) -> dict[str, Any]:
    """The engine's drafter (trainable tensors) and version: what --resume puts back."""
    drafter = engine.model_drafter
    if drafter is None or version is None:
        return {}
    return {"tensors": {n: t.detach() for n, t in trainable_named_tensors(drafter)},
            "version": int(version)}


def load_engine_drafter(engine: Rollout, resume: dict, version: int | None
                        ) -> int | None:
    """Puts a checkpoint's drafter back into the engine; returns its version."""
    if "tensors" not in resume or engine.model_drafter is None:
        return version
    return engine.load_drafter_weights(list(resume["tensors"].items()),
                                       version=int(resume["version"]))
