#!/usr/bin/env bash
# The test command: lint, then the CPU test suite (tests/gpu is skipped without CUDA). The first
# run also trains the cached bootstrap policy (~3-4 min on 2 cores) for the end-to-end tests.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
"$VENV/bin/ruff" check fastdraft tests
"$VENV/bin/python" -m pytest -q "$@"
