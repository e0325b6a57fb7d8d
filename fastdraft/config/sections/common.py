"""Shared by the sections: the dtypes a recipe may name and the check that raises a user error."""

from __future__ import annotations

from fastdraft.errors import FastdraftError

DTYPES = ("float32", "bfloat16", "float16")


def require(ok: bool, message: str) -> None:
    if not ok:
        raise FastdraftError(message)
