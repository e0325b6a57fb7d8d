"""Weight pushes in buckets: the actor's tensors streamed to the rollout side in groups of a
bounded size, so the sender never holds more than a bucket of host copies at once (the Ray
pool's object-store puts, the vLLM backend's RPC blobs)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch

_LAYER = re.compile(r"^(.*?layers\.\d+)\.")


def decoder_layer(name: str) -> str:
    """The decoder layer a tensor belongs to ("model.layers.3"), or its own name outside one."""
    match = _LAYER.match(name)
    return match.group(1) if match else name


def weight_buckets(named: Iterable[tuple[str, torch.Tensor]], limit: int,
                   together: Callable[[str], str] | None = None
                   ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Host copies of the tensors in groups of at most `limit` bytes (a bigger tensor alone).
    together: tensors with the same together(name), consecutive in `named`, stay in one
    bucket, whatever its size (vLLM reloads a fused layer only from all of its parts)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size, last = 0, None
    for name, tensor in named:
        tensor = tensor.detach().cpu()
        key = together(name) if together is not None else None
        if bucket and size + tensor.nbytes > limit and (key is None or key != last):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.nbytes
        last = key
    if bucket:
        yield bucket
