"""A device's peak bytes in each phase of an RL step, as the run's memory plan counts them
(actor/memory_plan.py RunPlan.phases); the device must hold the largest.

- rollout: the engine generating: its KV cache, its CUDA graphs' pool and its largest step's
  scratch;
- update: the actor's forward and backward (its transient: gradients, gathered parameters,
  activations, a chunk's logits); on a hybrid GPU the engine has given back its KV cache and
  graph pool (engine/updates.py sleep);
- sync: the new weights gathered into the engine (the weight push), then the online drafter's
  broadcast to every worker; on a hybrid GPU the cache and the pool are still given back: the
  engine loads its weights asleep and takes its cache back at the next generate.
Each figure holds what stays through every phase too: the engine's weights, drafter and step
buffers, the actor's state, a drafter trainer member, the CUDA contexts and NCCL buffers
(actor/runtime_memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastdraft.utils.device_memory import GB, gb

PHASES = ("rollout", "update", "sync")


@dataclass(frozen=True, kw_only=True, slots=True)
class PhasePeaks:
    """Bytes at each phase's peak on one device (on the CPU: the RAM)."""

    rollout: int
    update: int
    sync: int

    @property
    def peak(self) -> int:
        return max(self.rollout, self.update, self.sync)

    @property
    def largest(self) -> str:
        """The phase whose peak the device must hold (the first of PHASES on a tie)."""
        return max(PHASES, key=lambda phase: getattr(self, phase))

    def describe(self) -> str:
        """'rollout 67.4 GB | update 65.7 GB | sync 52.9 GB'."""
        return " | ".join(f"{phase} {gb(getattr(self, phase))}" for phase in PHASES)

    def as_dict(self) -> dict[str, int]:
        return {phase: getattr(self, phase) for phase in PHASES}

    def as_metrics(self) -> dict[str, float]:
        """The plan's peaks as a run's metrics name them, in decimal GB (to set beside what a
        device measured in the same phase)."""
        return {f"memory/plan_{phase}_gb": getattr(self, phase) / GB for phase in PHASES}
