"""Values that may be Ray object references: a rollout worker's samples travel to the drafter
trainer as one (worker -> trainer through Ray's object store, never through the driver), and
whoever needs the values themselves takes them here. Ray is looked up, never imported: a
process that never loaded it holds no references."""

from __future__ import annotations

import sys
from typing import Any


def is_ref(value: Any) -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and isinstance(value, ray.ObjectRef)


def resolved(value: Any) -> Any:
    """value, or the object it refers to when it is a Ray ObjectRef."""
    return sys.modules["ray"].get(value) if is_ref(value) else value
