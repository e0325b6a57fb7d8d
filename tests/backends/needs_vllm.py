"""The vLLM tests' guard: skipped where vLLM is not installed (the main venv), but an error in
the vLLM venv's run (scripts/test.sh sets FASTDRAFT_REQUIRE_VLLM), so a broken vLLM install
can never pass as skipped tests."""

from __future__ import annotations

import importlib
import os

import pytest


def needs_vllm() -> None:
    if os.environ.get("FASTDRAFT_REQUIRE_VLLM"):
        importlib.import_module("vllm")
    else:
        pytest.importorskip("vllm")
