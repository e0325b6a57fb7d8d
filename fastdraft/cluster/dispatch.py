"""Rollout dispatch: which worker runs each GRPO group. A group always goes whole to one worker
(its prompt is prefilled there once and its samples finish close together). The policies are
registered by name (`cluster.dispatch`); each maps the groups' predicted costs to a worker per
group, deterministically, so a rollout's placement is the same in every run. The RolloutPool
and the cluster simulator both dispatch through `assign_groups`."""

from __future__ import annotations

from collections.abc import Callable

from fastdraft.errors import FastdraftError
from fastdraft.utils.registry import Registry

DispatchFn = Callable[[list[float], int], list[int]]
_DISPATCH: Registry[DispatchFn] = Registry("dispatch policy")


def assign_groups(costs: list[float], workers: int, policy: str) -> list[int]:
    """The worker of each group, given the groups' predicted costs (e.g. answer tokens)."""
    if workers < 1:
        raise FastdraftError(f"dispatch needs >= 1 worker, got {workers}")
    return _DISPATCH.get(policy)(list(costs), workers)


def _longest_first(costs: list[float]) -> list[int]:
    return sorted(range(len(costs)), key=lambda g: (-costs[g], g))


@_DISPATCH.register("round_robin")
def round_robin(costs: list[float], workers: int) -> list[int]:
    return [g % workers for g in range(len(costs))]


@_DISPATCH.register("balance")
def balance(costs: list[float], workers: int) -> list[int]:
    """Longest predicted group first onto the least-loaded worker (LPT): the workers finish
    together, so no device waits on another's tail."""
    load = [0.0] * workers
    out = [0] * len(costs)
    for g in _longest_first(costs):
        w = min(range(workers), key=lambda i: (load[i], i))
        out[g] = w
        load[w] += costs[g]
    return out


@_DISPATCH.register("concentrate")
def concentrate(costs: list[float], workers: int) -> list[int]:
    """The longest groups packed together: worker 0 takes groups longest first until it holds
    its even share of the groups (ceil(groups / workers)), then worker 1, and so on. The
    workers holding short groups finish early and go idle together, where the drafter trains,
    while the long tail runs on few workers at the small batch where speculation pays most."""
    share = -(-len(costs) // workers)
    out = [0] * len(costs)
    for rank, g in enumerate(_longest_first(costs)):
        out[g] = rank // share
    return out
