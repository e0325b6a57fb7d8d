"""How many bytes a memory plan may use on a device: what is free there now, less a margin for
what no plan counts, less what others sharing the device will need.

CUDA: `torch.cuda.mem_get_info` (the driver's free bytes, so the CUDA context and other
processes are already out of it; read in a child process by a process that computes on no GPU,
which then makes no CUDA context: `device_capacity(in_child=True)`). CPU: the machine's
available RAM (psutil, else /proc/meminfo's MemAvailable). Figures are decimal (1 GB = 1e9
bytes), as GPU memory is sold.

The margin, max(1 GiB, 5% of the device): the caching allocator rounds blocks up (2 MiB pages,
20 MiB segments) and fragments under varying shapes; cuBLAS / cuDNN workspaces, NCCL's buffers
beyond the run plan's budget of them and a drafter trainer process's own CUDA context (outside
hybrid placement) take memory outside any plan (the run plan counts the CUDA contexts and NCCL
communicators it knows of: actor/runtime_memory.py). `reserved`
is what a caller keeps for others on the same device: a run builds its engine first and its
actor's rank 0 after it, on the same GPU, so it reserves the actor's plan for rank 0 there.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from fastdraft.errors import FastdraftError

GB = 10**9
GIB = 2**30
MARGIN_FRACTION = 0.05
MIN_MARGIN = GIB


def gb(num_bytes: float) -> str:
    """'116.7 GB' (decimal), or MB / KB for small amounts."""
    for unit, size in (("GB", GB), ("MB", 10**6), ("KB", 10**3)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{int(num_bytes)} B"


def margin_for(total: int) -> int:
    return max(MIN_MARGIN, int(MARGIN_FRACTION * total))


@dataclass(frozen=True, kw_only=True, slots=True)
class Capacity:
    """device: where; total: its size; free: bytes free now; margin: kept back (see above);
    reserved: kept for others sharing the device (e.g. the actor's rank 0)."""

    device: str
    total: int
    free: int
    margin: int
    reserved: int = 0

    def __post_init__(self) -> None:
        if min(self.total, self.free, self.margin, self.reserved) < 0:
            raise FastdraftError(f"capacity of {self.device}: byte counts must be >= 0")

    @classmethod
    def of(cls, device: str, total: int, free: int | None = None, reserved: int = 0
           ) -> Capacity:
        """free defaults to total (a whole device, as a dry run assumes)."""
        return cls(device=device, total=total, free=total if free is None else free,
                   margin=margin_for(total), reserved=reserved)

    @property
    def usable(self) -> int:
        return max(self.free - self.margin - self.reserved, 0)

    def describe(self) -> str:
        """'75.0 GB usable on cuda:0 (79.2 GB free - 4.2 GB margin - 30.1 GB reserved)'."""
        parts = [f"{gb(self.free)} free", f"{gb(self.margin)} margin"]
        if self.reserved:
            parts.append(f"{gb(self.reserved)} reserved")
        return f"{gb(self.usable)} usable on {self.device} ({' - '.join(parts)})"


def device_capacity(device: str | torch.device, reserved: int = 0, *,
                    in_child: bool = False) -> Capacity:
    """What is free on `device` now (CUDA: that GPU; anything else: host RAM). in_child: a
    process that computes on no GPU (the driver of hybrid workers) reads a GPU's figures in a
    short child process (`gpu_memory_in_child`) unless it initialised CUDA already, so it makes
    no CUDA context of its own there: ~0.5 GB of the device its workers plan with."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else 0
        if in_child and not torch.cuda.is_initialized():
            free, total = gpu_memory_in_child(index)
        else:
            free, total = torch.cuda.mem_get_info(torch.device("cuda", index))
        return Capacity.of(f"cuda:{index}", total, free, reserved)
    total, available = host_memory()
    return Capacity.of(device.type, total, available, reserved)


#: What the child process runs: (free, total) bytes of GPU argv[1], then it exits (its CUDA
#: context goes with it).
_READ_GPU = ("import sys, torch; free, total = torch.cuda.mem_get_info(int(sys.argv[1])); "
             "print(free, total)")
CHILD_TIMEOUT_S = 120.0   # starting Python, importing torch and a CUDA context: seconds


def gpu_memory_in_child(index: int) -> tuple[int, int]:
    """(free, total) bytes of CUDA device `index` as a child process of this Python sees them
    (the same CUDA_VISIBLE_DEVICES); its own context is counted used, as the worker's will be."""
    try:
        done = subprocess.run([sys.executable, "-c", _READ_GPU, str(index)], capture_output=True,
                              text=True, timeout=CHILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise FastdraftError(f"reading cuda:{index}'s free memory took over "
                             f"{CHILD_TIMEOUT_S:g} s: check the GPU with nvidia-smi") from None
    figures = done.stdout.split()
    if done.returncode or len(figures) != 2:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise FastdraftError(f"could not read cuda:{index}'s free memory ({why}): check the "
                             "GPU with nvidia-smi and CUDA_VISIBLE_DEVICES")
    return int(figures[0]), int(figures[1])


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of this machine's RAM."""
    try:
        import psutil
    except ImportError:
        return _meminfo()
    vm = psutil.virtual_memory()
    return int(vm.total), int(vm.available)


def _meminfo(path: Path = Path("/proc/meminfo")) -> tuple[int, int]:
    fields = {}
    for line in path.read_text().splitlines():
        name, _, value = line.partition(":")
        fields[name] = int(value.split()[0]) * 1024   # kB
    return fields["MemTotal"], fields.get("MemAvailable", fields.get("MemFree", 0))


def process_peak_bytes() -> int:
    """This process's peak resident memory (Linux's VmHWM: its own, unlike getrusage's
    ru_maxrss, which a process started from a large one inherits across fork and exec)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")


def check_device_option(device: str, flag: str) -> None:
    """A command's device option names a device this torch has, told before any work (torch's
    own error is an assertion deep inside the first allocation)."""
    if re.fullmatch(r"cpu|cuda(:\d+)?", device) is None:
        raise FastdraftError(f"{flag} must be cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        build = ("a CPU build" if torch.version.cuda is None else "a CUDA build that sees no GPU")
        raise FastdraftError(f"{flag} {device}, but this torch ({torch.__version__}) is {build}: "
                             f"install a CUDA build (README: Run on a GPU) or use {flag} cpu")
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        raise FastdraftError(f"{flag} {device}, but this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
