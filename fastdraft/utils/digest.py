"""tensor_digest: one short hash of named tensors (names, dtypes, shapes and bytes), so two
sides can tell bit-identical weights apart from any change: the bootstrap's reproducibility
check and the checksum of a published drafter."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


def tensor_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 (first 16 hex digits), over the tensors in name order (so any order of the
    same named tensors gives the same digest)."""
    sha = hashlib.sha256()
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        tensor = tensor.detach().cpu().contiguous()
        sha.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        sha.update(tensor.view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()[:16]
