"""The drafter's health over a run: the collapse check that makes the engine fall back to plain
decoding, the way back (a re-probe of a newer drafter), and the tally of what went wrong with
the online trainer. All of it is checkpointed: a resumed run neither forgets a fallback (and
silently speculates again with the drafter it had given up on) nor its counters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from fastdraft.config.engine import SpecConfig
from fastdraft.drafter.checkpoint import trainable_named_tensors
from fastdraft.engine.rollout import Rollout
from fastdraft.trainer.spot import Published

#: Accept length at or below this, over HEALTH_WINDOW steps, means the drafter is broken.
COLLAPSED_ACCEPT_LENGTH, HEALTH_WINDOW = 1.5, 3


def health_check(engine: Rollout, history: list[float], accept_length: float) -> bool:
    """Records the step's accept length; after HEALTH_WINDOW steps at or below
    COLLAPSED_ACCEPT_LENGTH the engine falls back to plain decoding (True): a broken drafter
    (zeroed, misloaded, or for another policy) must never make rollouts slower than plain."""
    history.append(accept_length)
    del history[:-HEALTH_WINDOW]   # all the check reads: a run of days keeps no more
    if len(history) < HEALTH_WINDOW or max(history) > COLLAPSED_ACCEPT_LENGTH:
        return False
    engine.fall_back_to_plain(f"accept length {[round(a, 3) for a in history]} <= "
                              f"{COLLAPSED_ACCEPT_LENGTH} for {HEALTH_WINDOW} steps: the "
                              "drafter is broken")
    print(f"drafter: falling back to plain decoding: {engine.fallback_reason}")
    return True


@dataclass(slots=True)
class DrafterHealth:
    """history: the collapse check's window; fallback / reason: the engine decodes plainly and
    why; steps_in_fallback: steps since (the re-probe's clock); the rest count events since the
    run began (resumes included)."""

    history: list[float] = field(default_factory=list)
    fallback: bool = False
    reason: str | None = None
    steps_in_fallback: int = 0
    fallbacks: int = 0
    reprobes: int = 0
    worker_failures: int = 0
    restarts: int = 0
    rejected: int = 0
    trainer_steps_at_fallback: int = 0   # a re-probe waits for a drafter trained since

    def observe(self, engine: Rollout, accept_length: float | None) -> bool:
        """One step's accept length (None: nothing was drafted). True when this step made the
        engine fall back."""
        if self.fallback:
            self.steps_in_fallback += 1
            return False
        if accept_length is None or not health_check(engine, self.history, accept_length):
            return False
        self.fallback, self.reason = True, engine.fallback_reason
        self.steps_in_fallback = 0
        self.fallbacks += 1
        return True

    def due_for_reprobe(self, every: int) -> bool:
        return self.fallback and every > 0 and self.steps_in_fallback >= every

    def resume_speculation(self, engine: Rollout, spec: SpecConfig) -> None:
        """Speculation back on with `spec` (what the engine ran before the fallback; its
        envelope, caches and proposer are unchanged by a fallback), with a fresh window: the
        newly loaded drafter must collapse again for HEALTH_WINDOW steps to be dropped."""
        engine.resume_speculation(spec)
        self.fallback, self.reason = False, None
        self.history.clear()
        self.steps_in_fallback = 0
        self.reprobes += 1

    def metrics(self) -> dict[str, float]:
        return {"drafter/fallback": float(self.fallback),
                "drafter/fallbacks": float(self.fallbacks),
                "drafter/worker_failures": float(self.worker_failures),
                "drafter/restarts": float(self.restarts),
                "drafter/rejected": float(self.rejected)}

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any] | None, engine: Rollout) -> None:
        """Restores a checkpoint's health (None: a checkpoint from before it was saved) and,
        if the run had fallen back, the engine's fallback with it."""
        if not state:
            return
        for f in fields(self):
            if f.name in state:
                setattr(self, f.name, state[f.name])
        self.history = [float(a) for a in self.history]
        if self.fallback and engine.spec.enabled:
            engine.fall_back_to_plain(f"{self.reason} (restored from the checkpoint)")
            print(f"drafter: plain decoding, as before the resume: {self.reason}")


def published_problem(published: Published, engine: Rollout
                      ) -> tuple[str | None, bool]:
    """(why a published drafter must not be loaded, whether its trainer diverged); (None,
    False): it may be loaded. Refused: other tensors than the engine's drafter has, or
    non-finite values (a diverged trainer). The checksum is the engine's to check."""
    expected = {n: t.shape for n, t in trainable_named_tensors(engine.model_drafter)}
    got = {n: t.shape for n, t in published.tensors}
    if got != expected:
        return (f"its tensors {sorted(set(got) ^ set(expected))[:3]} differ from the "
                "drafter's"), False
    bad = [n for n, t in published.tensors if not bool(torch.isfinite(t).all())]
    return (f"non-finite values in {bad[:3]}", True) if bad else (None, False)
