#!/usr/bin/env bash
# The test command: lint, then the CPU test suite (tests/gpu is skipped without CUDA) on two
# pytest-xdist workers (tests that start a Ray cluster share one worker: group "ray"). With no
# arguments, the cached bootstrap policies the end-to-end tests use are trained first (~5 min on
# 2 cores the first time; each trains on both cores), so no two workers train the same one, and
# the vLLM backend's tests run last in the vLLM venv (.venv-vllm, scripts/setup-vllm.sh; set up
# here in the background while the policies train if it is missing; FASTDRAFT_SKIP_VLLM=1
# leaves them out).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
"$VENV/bin/ruff" check fastdraft tests
SETUP_PID=
if [ $# -eq 0 ] && [ -z "${FASTDRAFT_SKIP_VLLM:-}" ] && [ ! -x "$VLLM_VENV/bin/vllm" ]; then
    echo "test.sh: setting up $VLLM_VENV in the background (log: $VLLM_VENV.setup.log)"
    nice -n 19 bash scripts/setup-vllm.sh > "$VLLM_VENV.setup.log" 2>&1 &
    SETUP_PID=$!
fi
if [ $# -eq 0 ]; then
    "$VENV/bin/fastdraft" bootstrap
    "$VENV/bin/fastdraft" bootstrap --spec tiny-qwen3
fi
"$VENV/bin/python" -m pytest -q -n "${FASTDRAFT_TEST_WORKERS:-2}" --dist loadgroup --durations=25 "$@"
if [ $# -eq 0 ] && [ -z "${FASTDRAFT_SKIP_VLLM:-}" ]; then
    if [ -n "$SETUP_PID" ] && ! wait "$SETUP_PID"; then
        tail -30 "$VLLM_VENV.setup.log"
        echo "test.sh: scripts/setup-vllm.sh failed (above); FASTDRAFT_SKIP_VLLM=1 skips vLLM"
        exit 1
    fi
    # after the main suite: they reuse the miniature test's cached drafter
    FASTDRAFT_REQUIRE_VLLM=1 "$VLLM_VENV/bin/python" -m pytest -q --durations=5 \
        tests/backends/test_vllm_rollout.py \
        tests/backends/test_vllm_speculators.py \
        tests/backends/test_vllm_run.py \
        tests/backends/test_vllm_tp.py
fi
