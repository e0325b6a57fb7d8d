"""Registry: variants registered by name (advantage estimators, policy losses, rewards), so a
recipe names one and a user adds their own with a decorator."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from fastdraft.errors import FastdraftError

_V = TypeVar("_V")


class Registry(Generic[_V]):
    def __init__(self, kind: str) -> None:
        self.kind = kind            # in messages: "policy loss", "reward", ...
        self._items: dict[str, _V] = {}

    def register(self, name: str) -> Callable[[_V], _V]:
        """Decorator: registers its target under ``name`` (re-registering the same one is a
        no-op, another one under a taken name an error)."""
        def decorate(item: _V) -> _V:
            if self._items.get(name, item) is not item:
                raise FastdraftError(f"{self.kind} {name!r} is already registered")
            self._items[name] = item
            return item
        return decorate

    def names(self) -> list[str]:
        return sorted(self._items)

    def get(self, name: str) -> _V:
        if name not in self._items:
            raise FastdraftError(f"unknown {self.kind} {name!r}: choose one of {self.names()}")
        return self._items[name]

    def __contains__(self, name: object) -> bool:
        return name in self._items
