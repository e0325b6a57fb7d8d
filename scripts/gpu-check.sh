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
# GPU_CHECK_PARTS: which parts run, in this order (default "tests bench"); "rl" runs RL steps on
# the GPU: the miniature real recipe (one actor rank: FSDP2 ranks need a GPU each) and, where
# Ray is installed, the tiny recipe with 2 rollout workers sharing this one GPU
# (cluster.gpus_per_worker=0.5) and the miniature on one hybrid worker; GPU_CHECK_STEPS steps
# each (default 3). Each run's log, metrics.jsonl and memory plan land in OUT_DIR. "warmup" runs
# `drafter warmup --device cuda` on the miniature's policy (EAGLE-3, 512 rollouts, 400 steps of
# 1024 tokens) and on the CPU beside it: capture and training tokens/s in OUT_DIR/warmup_*.log.
# "long": decode at contexts 4096 and 16384 with the gather and the Triton kernel, then the
# long-answer miniature (recipes/tiny-qwen3-long.yaml) in bf16 with rollout.paged_attention=triton.
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
tests() {
  "$py" -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$out/gpu_tests.log" || status=1
  if [[ ${GPU_CHECK_FULL:-0} == 1 ]]; then
    "$py" -m pytest -q -p no:cacheprovider -m "not gpu" tests 2>&1 | tail -15 \
      | tee "$out/cpu_suite.log" || status=1
  fi
}
fastdraft() { "$py" -c "from fastdraft.cli import main; raise SystemExit(main())" "$@"; }
rl_run() {   # NAME RECIPE OVERRIDES...: a few steps on the GPU, its log and metrics in $out
  local name=$1 dir; dir=$(mktemp -d); shift
  fastdraft run --run-dir "$dir/$name" "$@" model.device=cuda logging.wandb.mode=disabled \
    "algorithm.num_steps=${GPU_CHECK_STEPS:-3}" 2>&1 | tee "$out/$name.log" || status=1
  cp "$dir/$name/metrics.jsonl" "$out/$name.metrics.jsonl" || status=1
  cp "$dir/$name/memory_plan.json" "$out/$name.memory_plan.json" || status=1
  rm -rf "$dir"
}
rl() {
  rl_run rl_miniature recipes/tiny-qwen3-eagle3.yaml actor.num_ranks=1
  if "$py" -c "import ray" 2>/dev/null; then
    rl_run rl_ray_2workers_1gpu recipes/tiny-grpo.yaml cluster.backend=ray \
      cluster.rollout_workers=2 cluster.gpus_per_worker=0.5
    # one hybrid worker: actor rank + engine replica + the online drafter's trainer member in
    # one process, the sync on the GPU (timing/push_s), the KV cache released for the update
    # and the graphs captured again, its checkpoint sharded (torch.distributed.checkpoint)
    rl_run rl_hybrid_miniature recipes/tiny-qwen3-eagle3.yaml cluster.backend=ray \
      cluster.placement=hybrid cluster.rollout_workers=1 actor.num_ranks=1
  else
    echo "rl: Ray is not installed here: the Ray runs are skipped"
  fi
}
long() {   # issue 41's GPU points: decode at 4k and 16k context, gather vs the Triton kernel
  # (bench gpu's paged_gather / paged_triton rows), then the long-answer miniature with the
  # kernel serving every decode and verify step, in bf16 (the gate must hold every step)
  fastdraft bench gpu --device cuda --dtype bfloat16 --no-compile --repeats 2 \
    --contexts 4096,16384 --parts decode --json "$out/bench_gpu_long.json" 2>&1 \
    | tee "$out/bench_gpu_long.log" || status=1
  rl_run rl_long_triton recipes/tiny-qwen3-long.yaml actor.num_ranks=1 model.dtype=bfloat16 \
    actor.compute_dtype=bfloat16 rollout.paged_attention=triton
}
warmup() {   # the device warm-up on this GPU, and the same on its CPU for the ratio
  local policy dir; dir=$(mktemp -d)
  policy=$("$py" -c "from fastdraft.bootstrap.run import run_bootstrap
print(run_bootstrap(None, spec='tiny-qwen3', log=lambda *_: None).policy_dir)") || status=1
  for device in cuda cpu; do
    fastdraft drafter warmup --policy "$policy" --kind eagle3 --num-rollouts 512 --steps 400 \
      --token-budget 1024 --device "$device" --out "$dir/drafter-$device" 2>&1 \
      | tr '\r' '\n' | grep -v "it/s\|step/s\|rollout/s" | tee "$out/warmup_$device.log" || status=1
  done
  rm -rf "$dir"
}
bench() {
  for run in ${GPU_CHECK_BENCH:-gpu:bfloat16:--no-compile+--repeats+2 spec:float32}; do
    IFS=: read -r which dtype extra <<<"$run"
    name=bench_${which}_${dtype}${extra:+_${extra//[^a-z0-9]/}}
    # shellcheck disable=SC2086  # extra holds several arguments
    fastdraft bench "$which" --device cuda --dtype "$dtype" --json "$out/$name.json" \
      ${extra//+/ } 2>&1 | tee "$out/$name.log" || status=1
  done
}
for part in ${GPU_CHECK_PARTS:-tests bench}; do
  case $part in
    tests|rl|bench|warmup|long) "$part" ;;
    *) echo "GPU_CHECK_PARTS: unknown part $part (tests, rl, bench, warmup, long)"; exit 2 ;;
  esac
done
exit $status
