#!/usr/bin/env bash
# On a CUDA machine: the GPU tests, then the speculative-decoding bench on the GPU. No install:
# the tree runs from PYTHONPATH against the machine's own torch (>= 2.6) and transformers.
#   bash scripts/gpu-check.sh [OUT_DIR]      # logs and bench JSON land in OUT_DIR (default runs/gpu)
# Set FASTDRAFT_CACHE to a copy of a cache that holds the bootstrap policy and its drafter, or the
# first bench trains them (minutes). GPU_CHECK_FULL=1 also runs the whole CPU suite on this
# machine's torch. GPU_CHECK_BENCH lists the bench runs as WHICH:DTYPE[:EXTRA+ARGS], e.g.
#   GPU_CHECK_BENCH="spec:bfloat16 engine:float32:--no-compile gpu:bfloat16:--parts+cycle,memory"
# (default: the real-shape GPU bench without torch.compile, then the fp32 spec bench, where
# greedy speculative output must equal plain output). `bench gpu` with torch.compile spends
# minutes compiling on a fresh machine: ask for it explicitly (gpu:bfloat16).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
status=0
nvidia-smi -L
"$py" -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'cuda', torch.cuda.is_available())"
"$py" -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$out/gpu_tests.log" || status=1
if [[ ${GPU_CHECK_FULL:-0} == 1 ]]; then
  "$py" -m pytest -q -p no:cacheprovider -m "not gpu" tests 2>&1 | tail -15 \
    | tee "$out/cpu_suite.log" || status=1
fi
for run in ${GPU_CHECK_BENCH:-gpu:bfloat16:--no-compile+--repeats+2 spec:float32}; do
  IFS=: read -r which dtype extra <<<"$run"
  name=bench_${which}_${dtype}${extra:+_${extra//[^a-z0-9]/}}
  # shellcheck disable=SC2086  # extra holds several arguments
  "$py" -c "from fastdraft.cli import main; raise SystemExit(main())" bench "$which" \
    --device cuda --dtype "$dtype" --json "$out/$name.json" ${extra//+/ } 2>&1 \
    | tee "$out/$name.log" || status=1
done
exit $status
