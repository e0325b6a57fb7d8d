"""Before a worker is started on a node: the node can run fastdraft and sees the paths its
workers load (the policy, the drafter, the run directory). Every node needs the same paths (a
shared filesystem or copies at the same place) and the same install; a node that lacks one is
one line naming the node and the path, instead of a worker's traceback from a load."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fastdraft.errors import FastdraftError


def look(paths: dict[str, str]) -> tuple[str, list[tuple[str, str]]]:
    """On a node: (its IP as Ray knows it, the (setting, path) pairs it cannot see)."""
    import ray
    return ray.util.get_node_ip_address(), [(key, path) for key, path in paths.items()
                                            if not os.path.exists(path)]


def check_nodes(group: Any, bundles: int, paths: dict[str, Path | None],
                timeout_s: float) -> None:
    """`look` on the node of every bundle of the placement group `group`; a FastdraftError for
    the first node that cannot import fastdraft or lacks a path. paths: setting -> path (None:
    not used by this run)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    wanted = {key: str(path) for key, path in paths.items() if path is not None}
    task = ray.remote(look)
    futures = [task.options(num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=i)).remote(wanted) for i in range(bundles)]
    for i, future in enumerate(futures):
        try:
            node, missing = ray.get(future, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise FastdraftError(f"the node of worker bundle {i} did not answer within "
                                 f"cluster.placement_timeout_s={timeout_s:g} s: check it with "
                                 "`ray status`") from None
        except ray.exceptions.RayError as err:
            raise FastdraftError(f"the node of worker bundle {i} cannot run fastdraft "
                                 f"({_first_line(err)}): install the same fastdraft (and its "
                                 "requirements) in the Python that `ray start` uses on every "
                                 "node") from None
        if missing:
            key, path = missing[0]
            raise FastdraftError(f"node {node} has no {key} {path} (worker bundle {i}): every "
                                 "node needs the run's paths at the same place (a shared "
                                 "filesystem, or copies there)")


def _first_line(err: BaseException) -> str:
    """The innermost error's line of a Ray task error (its traceback is the worker's)."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(err).__name__
