"""Device memory the CUDA driver and NCCL take outside any tensor, as budgets the run's memory
plan counts on each device (actor/memory_plan.py): not measured here.

- CUDA contexts: every process that touches a device holds a context there (the CUDA driver's
  state and the kernels of torch and its libraries as they load), CUDA_CONTEXT_BYTES each. On
  a device: the process computing there (a hybrid worker; an actor rank; on device 0 of the
  other layouts the driver itself, its engine and the actor's rank 0 in one process), and on
  every other device one for the driver too. The driver of hybrid workers computes on no GPU
  and is written to make no context (preflight reads free memory in a child process:
  utils/device_memory.py; RngState.capture reads no CUDA state where CUDA is not initialised),
  but nothing has confirmed that on a GPU yet, so its context stays budgeted.
- NCCL communicators: each holds its buffers for its lifetime, NCCL_BUFFSIZE (NCCL's default
  for it) for each of up to NCCL_CHANNELS channels. A device's processes are in: the actor
  ranks' group when it has two ranks or more (hybrid: the workers' group, which the FSDP2
  collectives, the weight sync's gathers and the drafter broadcast share), and with hybrid
  tensor parallelism the replica's group (models/tensor_parallel.py). A group of one rank has
  no peer to hold buffers for; gloo groups (a CPU run, the drafter trainers' data-parallel
  rounds) take host memory the plan's margin covers.
On the CPU neither exists: 0. Free bytes measured on a device are already without the contexts
there (the measuring process's, the driver's on model.device): the plan counts them all the
same, one figure for every device, and the engine's own check leaves its process's out of
what it reserves (RunPlan.engine_reserve).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastdraft.utils.device_memory import gb

MIB = 2**20
CUDA_CONTEXT_BYTES = 512 * MIB
NCCL_BUFFSIZE = 4 * MIB
NCCL_CHANNELS = 32
NCCL_COMMUNICATOR_BYTES = NCCL_CHANNELS * NCCL_BUFFSIZE


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeMemory:
    """The CUDA contexts and NCCL communicators on one device (see the module docstring)."""

    contexts: int = 0
    communicators: int = 0

    @classmethod
    def on_device(cls, *, cuda: bool, hybrid: bool, device0: bool, ranks: int,
                  tensor_parallel: int = 1) -> RuntimeMemory:
        """A device's: device0, the one the driver computes on outside hybrid placement (its
        engine and the actor's rank 0); ranks: the actor's; tensor_parallel: each hybrid
        engine replica's ranks."""
        if not cuda:
            return cls()
        own_process_is_driver = device0 and not hybrid
        groups = int(ranks > 1) + int(hybrid and tensor_parallel > 1)
        return cls(contexts=1 if own_process_is_driver else 2, communicators=groups)

    @property
    def nbytes(self) -> int:
        return self.contexts * CUDA_CONTEXT_BYTES + self.communicators * NCCL_COMMUNICATOR_BYTES

    def describe(self) -> str:
        """'2 CUDA contexts + 1 NCCL communicator 1.2 GB'."""
        parts = [f"{self.contexts} CUDA context{'s' if self.contexts != 1 else ''}"]
        if self.communicators:
            parts.append(f"{self.communicators} NCCL communicator"
                         f"{'s' if self.communicators != 1 else ''}")
        return " + ".join(parts) + f" {gb(self.nbytes)}"

    def as_dict(self) -> dict[str, int]:
        return {"contexts": self.contexts, "communicators": self.communicators,
                "bytes": self.nbytes}
