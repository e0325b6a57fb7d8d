"""Nested state dicts (optimizer, LR scheduler, RNG) as JSON + a flat dict of tensors.

`optimizer.state_dict()` mixes tensors (moments) with plain values (hyper-parameters, int keys,
tuples such as `betas`). safetensors holds only tensors and JSON only plain values, so each state
is split into a JSON skeleton whose tensor leaves are `{"__tensor__": key}` references into the
safetensors file. Tuples and dicts with non-string keys are tagged so they come back as they
went in: `load_state_dict` then sees exactly what `state_dict` gave.
"""

from __future__ import annotations

from typing import Any

import torch

_TENSOR, _TUPLE, _ITEMS = "__tensor__", "__tuple__", "__items__"
_SCALARS = (str, int, float, bool, type(None))


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy that owns its memory: the live tensor may change (or be freed) while
    the background writer still reads the copy."""
    return torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t.detach())


def flatten(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Returns the JSON skeleton of `obj`; its tensors are copied to host into `tensors` under
    keys that start with `prefix`. Unsupported leaves raise TypeError naming their path."""
    if isinstance(obj, torch.Tensor):
        assert prefix not in tensors, f"duplicate tensor key {prefix}"
        tensors[prefix] = to_host(obj)
        return {_TENSOR: prefix}
    if isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, tuple):
        return {_TUPLE: [flatten(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [flatten(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and k not in (_TENSOR, _TUPLE, _ITEMS) for k in obj):
            return {k: flatten(v, f"{prefix}/{k}", tensors) for k, v in obj.items()}
        return {_ITEMS: [[_plain_key(k, prefix), flatten(v, f"{prefix}/{k}", tensors)]
                         for k, v in obj.items()]}
    raise TypeError(f"checkpoint state {prefix!r} holds a {type(obj).__name__}; only tensors, "
                    "numbers, strings, None, lists, tuples and dicts can be saved")


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `flatten`. A missing tensor key raises KeyError (the caller names the file)."""
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if set(skeleton) == {_TENSOR}:
        return tensors[skeleton[_TENSOR]]
    if set(skeleton) == {_TUPLE}:
        return tuple(unflatten(v, tensors) for v in skeleton[_TUPLE])
    if set(skeleton) == {_ITEMS}:
        return {_key(k): unflatten(v, tensors) for k, v in skeleton[_ITEMS]}
    return {k: unflatten(v, tensors) for k, v in skeleton.items()}


def _plain_key(key: Any, prefix: str) -> Any:
    if isinstance(key, tuple):
        return {_TUPLE: [_plain_key(k, prefix) for k in key]}
    if isinstance(key, _SCALARS):
        return key
    raise TypeError(f"checkpoint state {prefix!r} has a {type(key).__name__} dict key")


def _key(key: Any) -> Any:
    return tuple(_key(k) for k in key[_TUPLE]) if isinstance(key, dict) else key
