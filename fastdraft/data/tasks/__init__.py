"""Verifiable synthetic tasks; importing this package registers the built-in ones."""

from fastdraft.data.tasks import modsum as _modsum  # noqa: F401  (registers "modsum")
from fastdraft.data.tasks.base import (
    Problem,
    Task,
    available_tasks,
    get_task,
    length_percentiles,
    register_task,
)

__all__ = [
    "Problem",
    "Task",
    "available_tasks",
    "get_task",
    "length_percentiles",
    "register_task",
]
