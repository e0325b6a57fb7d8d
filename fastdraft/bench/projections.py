"""The cluster simulator's projections for `fastdraft bench cluster` (labelled projections,
never measurements): worker counts and drafter modes at the 7B and 32B shapes, from `bench gpu`
JSON or the H100 floors below, and the 8B recipe's step in each layout of one 8-GPU node."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastdraft.bench.common import write_json
from fastdraft.cluster.simulator import StepShape, UnitCosts, long_tail_lengths, projections

# H100 floors at the Qwen2.5-7B shape with CUDA graphs (measured by an earlier `bench gpu`):
# a decode step 7.07 ms, a 13-token verify 1.11 decode steps, one draft level 0.044 decode
# steps (32k draft vocab). The per-row cost is the KV read of one 1500-token row at 3.35 TB/s
# (57 KB a token). 32B: the weight read scales with the parameters (32.8 / 7.6), as does the KV
# row (64 layers x 8 KV heads x 128 x 2 x 2 bytes = 262 KB a token). Both are projections.
H100_7B = UnitCosts(step_base_s=7.07e-3, step_row_s=1500 * 57e3 / 3.35e12, verify_factor=1.11,
                    draft_levels=6, draft_level_s=0.044 * 7.07e-3, prefill_token_s=2e-5)
H100_32B = UnitCosts(step_base_s=7.07e-3 * 32.8 / 7.6, step_row_s=1500 * 262e3 / 3.35e12,
                     verify_factor=1.11, draft_levels=6, draft_level_s=0.044 * 7.07e-3 * 32.8 / 7.6,
                     prefill_token_s=2e-5 * 32.8 / 7.6)
# 32B fits no 80 GB GPU beside an actor shard (recipes/qwen2.5-32b-dapo.yaml): its engines are
# tensor-parallel over 4 GPUs, two all-reduces a layer (64 layers) of a decode step's hidden
# states (~1 MB) at ~20 us on NVLink (an assumption, not a measurement).
TP_32B, LAYERS_32B, ALL_REDUCE_S = 4, 64, 20e-6


def run_projections(gpu_json: Path | None, json_path: Path | None = None) -> dict[str, Any]:
    """`bench cluster --simulate`: the simulator's projections alone, no runs (seconds): worker
    counts and modes, and the 8B recipe's step in each layout of one 8-GPU node."""
    out = {"projections": model_projections(gpu_json), "layouts": recipe_8b_layouts()}
    if json_path is not None:
        write_json(json_path, out)
    return out


def projection_lines(out: dict[str, Any]) -> list[str]:
    lines = [f"  projections ({out['projections']['source']}):"]
    for row in out["projections"]["rows"]:
        tp = f" tp{row['tensor_parallel']}" if row.get("tensor_parallel", 1) > 1 else "    "
        lines.append(f"    [projection] {row['model']:>3} x{row['workers']:<3}{tp} "
                     f"{row['mode']:<17} "
                     f"step {row['step_s']:7.1f}s idle {row['idle_fraction']:.2f} speedup vs "
                     f"plain {row['speedup_vs_plain']:.2f}")
    if "layouts" in out:
        layouts = out["layouts"]
        lines.append(f"  the 8B recipe's step on one node of 8 GPUs ({layouts['source']}):")
        for row in layouts["rows"]:
            lines.append(f"    [projection] {row['layout']:<10} {row['workers']} rolling out: "
                         f"rollout {row['rollout_s']:6.1f}s update {row['update_s']:5.1f}s push "
                         f"{row['push_s']:5.2f}s step {row['step_s']:6.1f}s "
                         f"({row['vs_one_engine']:.2f}x one_engine)")
    return lines


def recipe_8b_layouts() -> dict[str, Any]:
    """recipes/qwen3-8b-grpo.yaml's step (128 prompts x 8 answers, 64 slots an engine, answers
    of up to 2048 tokens) on 8 H100s in each layout (cluster/layouts.py), from the H100 floors
    scaled to 8.19B parameters."""
    from fastdraft.cluster.layouts import compare_layouts, update_s_estimate
    params, requests, prompt, mean_answer = 8.19e9, 1024, 300, 700
    scale = params / 7.6e9
    costs = UnitCosts(**{**H100_7B.__dict__, "step_base_s": H100_7B.step_base_s * scale,
                         "draft_level_s": H100_7B.draft_level_s * scale,
                         "prefill_token_s": H100_7B.prefill_token_s * scale})
    shape = StepShape(long_tail_lengths(requests, 8, mean_answer, 2.9, 2048, seed=0), 8, prompt)
    update = update_s_estimate(params, requests * (prompt + mean_answer), 8)
    return {"label": "projection", "rows": compare_layouts(shape, costs, 8, 64, update, params),
            "source": f"H100 floors x {scale:.2f}; answers lognormal mean {mean_answer}, p99 / "
                      "mean 2.9, up to 2048; accept length 3.0; update from FLOPs at 40% MFU "
                      f"({update:.1f} s); links: NVLink 150, PCIe 25, object store 5 GB/s"}


def model_projections(gpu_json: Path | None) -> dict[str, Any]:
    if gpu_json is not None:
        import json
        # `bench gpu` measures no prefill: the floors' per-token prefill stands in for it.
        costs = UnitCosts.from_gpu_bench(json.loads(Path(gpu_json).read_text()),
                                         prefill_token_s=H100_7B.prefill_token_s)
        source = (f"bench gpu JSON {gpu_json} (7B; prefill per token from the H100 floors); "
                  "32B scaled by parameters (32.8 / 7.6)")
        big = UnitCosts(**{**costs.__dict__, "step_base_s": costs.step_base_s * 32.8 / 7.6,
                           "draft_level_s": costs.draft_level_s * 32.8 / 7.6,
                           "prefill_token_s": costs.prefill_token_s * 32.8 / 7.6})
        models = {"7B": costs, "32B": big}
    else:
        source = "H100 floors at the 7B shape (7.07 ms decode, verify 1.11, draft level 0.044); " \
                 "32B scaled by parameters; no GPU measured in this run"
        models = {"7B": H100_7B, "32B": H100_32B}
    models["32B"] = models["32B"].over_ranks(TP_32B, LAYERS_32B, ALL_REDUCE_S)
    source += f"; 32B engines tensor-parallel over {TP_32B} GPUs ({ALL_REDUCE_S * 1e6:.0f} us " \
              "an all-reduce, assumed)"
    return {"label": "projection", "source": source,
            "rows": projections(models, tensor_parallel={"32B": TP_32B})}
