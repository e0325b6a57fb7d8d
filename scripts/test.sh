#!/usr/bin/env bash
# The test command: lint, then the CPU test suite (tests/gpu is skipped without CUDA) on two
# pytest-xdist workers (tests that start a Ray cluster share one worker: group "ray"). With no
# arguments, the cached bootstrap policies the end-to-end tests use are trained first (~5 min on
# 2 cores the first time; each trains on both cores), so no two workers train the same one.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
"$VENV/bin/ruff" check fastdraft tests
if [ $# -eq 0 ]; then
    "$VENV/bin/fastdraft" bootstrap
    "$VENV/bin/fastdraft" bootstrap --spec tiny-qwen3
fi
"$VENV/bin/python" -m pytest -q -n "${FASTDRAFT_TEST_WORKERS:-2}" --dist loadgroup --durations=25 "$@"
