#!/usr/bin/env bash
# One-command set-up: a virtual environment in .venv with PyTorch, fastdraft (editable) and the
# dev tools. PyTorch is installed first and deliberately: FASTDRAFT_TORCH picks the build
# (default: the CPU build torch==2.13.0). If the venv already has a torch >= 2.6 it is kept, so a
# CUDA build you installed yourself is never replaced by a multi-GB download.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
if ! "$VENV/bin/python" - <<'PY' 2>/dev/null; then
import torch, sys
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 6) else 1)
PY
  "${PIP[@]}" install "${FASTDRAFT_TORCH:-torch==2.13.0}"
fi
"${PIP[@]}" install -e ".[dev]"
"$VENV/bin/python" -c "import torch, fastdraft; print('fastdraft', fastdraft.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
