#!/usr/bin/env bash
# One-command set-up: a virtual environment in .venv with PyTorch, fastdraft (editable) and the
# dev tools. PyTorch is installed first and deliberately: FASTDRAFT_TORCH (default torch==2.13.0)
# names it. If the venv already has a torch >= 2.6 it is kept, so a CUDA build you installed
# yourself is never replaced by a multi-GB download.
#
# Which build: pip installs FASTDRAFT_TORCH from the index pip is set up with, and the build is
# whatever that index serves. This project's machines serve the CPU build (2.13.0+cpu); PyPI
# serves a CUDA build on Linux x86_64 (GBs of CUDA libraries). To choose, name an index
# (FASTDRAFT_TORCH_INDEX, passed as --index-url) and/or extra pip options (FASTDRAFT_PIP_OPTS,
# split on spaces); both apply to the torch install only:
#   FASTDRAFT_TORCH_INDEX=https://download.pytorch.org/whl/cpu bash scripts/setup.sh      # CPU
#   FASTDRAFT_TORCH=torch FASTDRAFT_TORCH_INDEX=https://download.pytorch.org/whl/cu126 \
#     bash scripts/setup.sh     # the newest CUDA 12.6 build that index has
#   FASTDRAFT_PIP_OPTS="--no-cache-dir" bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${FASTDRAFT_TORCH:-torch==2.13.0}
TORCH_OPTS=()
[ -z "${FASTDRAFT_TORCH_INDEX:-}" ] || TORCH_OPTS+=(--index-url "$FASTDRAFT_TORCH_INDEX")
read -r -a EXTRA <<<"${FASTDRAFT_PIP_OPTS:-}"
TORCH_OPTS+=(${EXTRA[@]+"${EXTRA[@]}"})
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
if KEPT=$("$VENV/bin/python" -c "import sys, torch; v = torch.__version__; print(v)
sys.exit(0 if tuple(int(x) for x in v.split('+')[0].split('.')[:2]) >= (2, 6) else 1)" 2>/dev/null)
then
  echo "setup.sh: keeping torch $KEPT already in $VENV (>= 2.6); FASTDRAFT_TORCH* not used"
else
  FROM=${FASTDRAFT_TORCH_INDEX:-the index pip is set up with}
  [ -z "${FASTDRAFT_PIP_OPTS:-}" ] || FROM="$FROM (pip options: $FASTDRAFT_PIP_OPTS)"
  echo "setup.sh: installing $TORCH_SPEC from $FROM; the build is what that index serves" \
       "(PyPI: a CUDA build on Linux; FASTDRAFT_TORCH_INDEX=URL picks another)"
  "${PIP[@]}" install ${TORCH_OPTS[@]+"${TORCH_OPTS[@]}"} "$TORCH_SPEC"
fi
"${PIP[@]}" install -e ".[dev]"
"$VENV/bin/python" -c "import torch, fastdraft; print('fastdraft', fastdraft.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
