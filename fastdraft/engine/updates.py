"""What changes in a RolloutEngine between generate calls, from outside: the policy's weights
after every actor update, the drafter's after every publish, speculation off (a drafter that
went bad) and on again, the state a resumed run puts back, the end of an RL step, and its
device memory given back while a colocated actor updates (sleep). Part of RolloutEngine (a
mixin: the engine's attributes are its own)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fastdraft.config.engine import SpecConfig
from fastdraft.engine.sleep import Released
from fastdraft.errors import FastdraftError
from fastdraft.models import load_named_tensors
from fastdraft.utils.digest import tensor_digest


class BetweenSteps:
    _released: Released

    def sleep(self, weights: bool | None = None) -> int:
        """Gives back the device memory of the policy's KV cache and, with weights, of its
        weights (copied to the host first) until a call needs them: generate wakes the
        engine by itself (`wake`), load_weights and load_drafter_weights its weights only.
        weights=None: on a CUDA device only (on the CPU they are host memory already). The
        drafter stays. Returns the bytes given back."""
        device = self.runner.device
        self.graphs.release()   # they read the storages freed here
        self._released.free([self.runner.kv_cache], keep=False)
        if weights if weights is not None else device.type == "cuda":
            self._released.free(self.model.parameters(), keep=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()   # to the driver: the actor rank is another process
        return self._released.nbytes

    @property
    def asleep(self) -> bool:
        return bool(self._released)

    def wake(self, cache: bool = True) -> None:
        """The memory `sleep` gave back, allocated again: the weights as they were, the cache
        zeroed (cache=False: the weights only; the cache stays given back until a call that
        reads it wakes it: generate). The graphs went with the sleep (their storages moved):
        each is captured again at its next run."""
        if self._released:
            self._released.restore(kept_only=not cache)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                     version: int | None = None) -> int:
        """Updates the policy in place (HF names, full tensors: a tensor-parallel rank takes
        its slices); returns the new policy version. An engine asleep gets its weights back
        first and its KV cache only at the next generate: the tensors, gathered as they are
        read (workers/hybrid.py), land while the cache's memory is still free for the gather,
        so a sync's peak is the gather's alone, never the cache's beside it
        (actor/memory_plan.py, the sync phase)."""
        self.wake(cache=False)
        load_named_tensors(self.model, self.model.local_tensors(named_tensors))
        self.proposer.refresh()
        self.policy_version = self.policy_version + 1 if version is None else version
        return self.policy_version

    def load_drafter_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                             version: int | None = None, checksum: str | None = None,
                             held_by: int | None = None) -> int:
        """Updates the drafter's trainable tensors in place; returns the new drafter version.
        checksum (utils/digest.tensor_digest of the tensors, as published): checked before
        anything is loaded, so a corrupted drafter never reaches the engine. held_by: the
        Rollout Protocol's (a pool of hybrid workers); an engine here has nothing to do with it."""
        self.wake(cache=False)   # the drafter may read the policy's embedding / head
        drafter = self.model_drafter
        if drafter is None:
            raise FastdraftError(f"spec method {self.spec.method!r} has no drafter to update")
        named_tensors = list(named_tensors)
        if checksum is not None and (got := tensor_digest(named_tensors)) != checksum:
            raise FastdraftError(f"drafter version {version}: the received tensors' checksum {got} "
                                 f"is not the published {checksum}; nothing was loaded")
        load_named_tensors(drafter, named_tensors)
        self.drafter_version = (self.drafter_version or 0) + 1 if version is None else version
        return self.drafter_version

    @property
    def model_drafter(self) -> torch.nn.Module | None:
        """The proposer's trained drafter (EAGLE), None for model-free proposers."""
        drafter = getattr(self.proposer, "drafter", None)
        return drafter if isinstance(drafter, torch.nn.Module) else None

    def fall_back_to_plain(self, reason: str) -> None:
        """Plain decoding from the next generate call on: a broken drafter must never make
        rollouts slower than plain decoding. `fallback_reason` says why."""
        self.spec = SpecConfig(method="none")
        self.drafter_version = None
        self.fallback_reason = reason

    def resume_speculation(self, spec: SpecConfig) -> None:
        """Speculation back on after `fall_back_to_plain` (between generate calls), with the
        config it ran before: the fallback left the envelope, caches and proposer as they
        were, and plain steps kept feeding the drafter."""
        if not spec.enabled:
            raise FastdraftError("resume_speculation needs a speculative spec (the one before the "
                                 "fallback)")
        self.spec, self.fallback_reason = spec, None

    def state_dict(self) -> dict:
        """What the engine learned by measuring and keeps across RL steps (JSON): the tuner's
        rewards, budgets' answer-length history, model-free drafters' rollout windows, the RL
        step. A resumed run loads it and rolls out as an unbroken one would."""
        parts = {"tuner": self.tuner, "budget": self.budget}
        return {"rl_step": self.rl_step, "proposer": self.proposer.state_dict(),
                **{name: part.state_dict() for name, part in parts.items() if part is not None}}

    def load_state_dict(self, state: dict) -> None:
        self.rl_step = int(state["rl_step"])
        self.proposer.load_state_dict(state["proposer"])
        if self.tuner is not None and "tuner" in state:
            self.tuner.load_state_dict(state["tuner"])
        if self.budget is not None and "budget" in state:
            self.budget.load_state_dict(state["budget"])

    def advance_step(self) -> None:
        """Marks the end of an RL step (model-free drafters slide their rollout window)."""
        self.rl_step += 1
        self.proposer.advance_step(self.rl_step)
        if self.budget is not None:
            self.budget.advance_step()

    def close(self) -> None:
        """(Rollout.close: an engine in this process started nothing of its own.)"""
