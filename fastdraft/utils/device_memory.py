"""How many bytes a memory plan may use on a device: what is free there now, less a margin for
what no plan counts, less what others sharing the device will need.

CUDA: `torch.cuda.mem_get_info` (the driver's free bytes, so the CUDA context and other
processes are already out of it). CPU: the machine's available RAM (psutil, else
/proc/meminfo's MemAvailable). Figures are decimal (1 GB = 1e9 bytes), as GPU memory is sold.

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


def device_capacity(device: str | torch.device, reserved: int = 0) -> Capacity:
    """What is free on `device` now (CUDA: that GPU; anything else: host RAM)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        name = f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
        return Capacity.of(name, total, free, reserved)
    total, available = host_memory()
    return Capacity.of(device.type, total, available, reserved)


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
