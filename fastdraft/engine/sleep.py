"""Device memory an engine gives back between rollouts, for colocated placement (the actor's
ranks update the policy on the rollout workers' own devices, as verl's hybrid engine does).

`Released` frees tensors' storages in place (`UntypedStorage.resize_(0)`, what FSDP does to
unsharded parameters): every view of them (packed qkv slices, per-layer K/V lists, the
drafter's tied head) stays the same Python object and sees the memory again once `restore`
resizes the storage back. Contents come back two ways: weights from a host copy taken at
release (`keep=True`), caches as zeros (`keep=False`: an empty cache reads as it did when it
was allocated; never stale bits, which could hold NaNs that a masked read multiplies by 0).
`restore(kept_only=True)` brings back the weights alone: an engine loading new weights while
asleep leaves its cache freed until a generate needs it (engine/updates.py).

A restored storage may live at another address, so a captured CUDA graph that read the old one
is void: the engine releases its graphs when it sleeps (they are captured again on first
use)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class _Freed:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.UntypedStorage | None   # the contents to put back; None: zeros


class Released:
    """Storages freed until `restore`; one entry per storage, however many tensors view it."""

    def __init__(self) -> None:
        self._freed: list[_Freed] = []

    def __bool__(self) -> bool:
        return bool(self._freed)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self._freed)

    def free(self, tensors: Iterable[torch.Tensor], keep: bool) -> None:
        """Frees the tensors' storages (skipping any freed already); keep: copy the contents to
        host memory first (pinned on CUDA, so the copy back runs at full bus speed)."""
        seen: set[int] = set()   # (a freed storage has no bytes: it is skipped below)
        for tensor in tensors:
            storage = tensor.untyped_storage()   # a new wrapper each call: keyed by address
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            host = None
            if keep:
                pin = storage.device.type == "cuda"
                host = torch.UntypedStorage(storage.nbytes(), device="cpu")
                host = (host.pin_memory() if pin else host).copy_(storage)
            self._freed.append(_Freed(storage, storage.nbytes(), host))
            storage.resize_(0)

    def restore(self, kept_only: bool = False) -> None:
        """Every freed storage at its size again, with its contents or zeros; kept_only: only
        those freed with their contents (the weights), the others (caches) stay freed."""
        still = []
        for freed in self._freed:
            if kept_only and freed.host is None:
                still.append(freed)
                continue
            freed.storage.resize_(freed.nbytes)
            if freed.host is not None:
                freed.storage.copy_(freed.host)
            else:
                freed.storage.fill_(0)
        self._freed = still
