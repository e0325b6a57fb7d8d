"""The engine arguments fastdraft gives vLLM (rollout.backend=vllm), apart from vLLM so they
are checked without it: tensor parallelism (rollout.tensor_parallel: vLLM's
tensor_parallel_size over that many devices), CUDA graphs on a GPU (eager on the CPU, where
vLLM has none), and on a GPU the share of each device vLLM may take, from the run's memory plan
(what the actor's rank and the drafter trainer keep on device 0; vLLM's own default, 0.9,
would take it from under them)."""

from __future__ import annotations

from typing import Any

from fastdraft.errors import FastdraftError
from fastdraft.utils.device_memory import gb

# Left free on each device beyond the plan's reserve: the CUDA context and allocator slack
# vLLM's profile does not count (the native engine's margin, utils/device_memory.py).
MARGIN = 0.05


def vllm_engine_args(*, device: str, tensor_parallel: int, max_batch_size: int,
                     max_seq_len: int, memory_reserve: int = 0,
                     device_bytes: int | None = None) -> dict[str, Any]:
    """LLM(...) keyword arguments. memory_reserve: bytes of device 0 the run keeps for itself
    (RunPlan.engine_reserve); device_bytes: a device's total memory (on a GPU: required)."""
    args: dict[str, Any] = {"tensor_parallel_size": tensor_parallel,
                            "max_num_seqs": max_batch_size}
    if not device.startswith("cuda"):
        # A prompt prefilled in chunks has its chunk's sampled token discarded and its seeded
        # generator rewound (set_offset), which CPU generators refuse: whole prompts.
        return {**args, "enforce_eager": True, "enable_chunked_prefill": False,
                "max_num_batched_tokens": max(max_seq_len, 8192)}
    if not device_bytes:
        raise ValueError("vllm_engine_args on a GPU needs the device's total memory")
    share = (device_bytes - memory_reserve) / device_bytes - MARGIN
    if share < 0.1:
        raise FastdraftError(
            f"rollout.backend=vllm: the run keeps {gb(memory_reserve)} of the "
            f"{gb(device_bytes)} on device 0 for the actor, which leaves vLLM "
            f"{max(share, 0.0):.0%} of it: lower actor.micro_batch_tokens or raise "
            "actor.num_ranks (a smaller actor shard), or use devices with more memory")
    return {**args, "enforce_eager": False, "gpu_memory_utilization": round(share, 3)}


def cpu_thread_binding(cores: list[int], tensor_parallel: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for vLLM's CPU workers: this process's cores split into
    tensor_parallel contiguous groups, "0-3|4-7" (vLLM binds a worker per NUMA node by itself
    and refuses more workers than nodes)."""
    cores = sorted(cores)
    if len(cores) < tensor_parallel:
        raise FastdraftError(f"rollout.tensor_parallel={tensor_parallel} on the CPU gives each "
                             f"vLLM worker a core of its own, and this process has "
                             f"{len(cores)}: lower rollout.tensor_parallel")
    per = len(cores) // tensor_parallel
    groups = [cores[i * per:(i + 1) * per] for i in range(tensor_parallel)]
    return "|".join(",".join(map(str, g)) for g in groups)
