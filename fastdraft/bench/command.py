"""`fastdraft bench WHICH`: its arguments and the dispatch to each bench (engine, spec, gpu,
recipe, drafter, rollout, cluster, hybrid, kv). cli.py registers it; torch and the benches load
inside the runner so `--help` stays fast."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from fastdraft.errors import FastdraftError

if TYPE_CHECKING:  # annotations only
    import torch


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """The options, grouped by the benches that read them (`fastdraft bench --help`)."""
    p.add_argument("which", choices=["engine", "spec", "gpu", "recipe", "drafter", "rollout",
                                     "cluster", "hybrid", "kv", "update", "tp"],
                   help="what to benchmark")
    p.add_argument("recipe_args", nargs="*", default=[],
                   help="recipe, drafter, rollout, cluster, hybrid, kv: RECIPE.yaml "
                        "[section.key=value ...] (default: recipes/tiny-grpo.yaml)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="recipe, drafter, rollout: where the runs go (default: runs/bench-WHICH)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    p.add_argument("--overwrite", action="store_true",
                   help="--json may replace a file fastdraft did not write")
    p.add_argument("--model", type=Path, default=None, help="default: the bootstrap policy")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--max-new-tokens", type=int, default=160, help="answer budget per prompt")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed repeats (rollout, kv: rounds after the warm-up round)")
    p.add_argument("--num-prompts", type=int, default=16,
                   help="prompts per row, rolled out batch_size at a time")
    g = p.add_argument_group("engine (and spec, gpu where named)")
    g.add_argument("--batch-sizes", default=None, help="engine: 1,16; spec: 1,4,16; tp: 1,8")
    g.add_argument("--no-compile", action="store_true",
                   help="engine: skip the torch.compile'd engine rows (saves ~1 min); "
                        "gpu: measure without torch.compile")
    g = p.add_argument_group("spec: speculation methods side by side")
    g.add_argument("--methods", default="none,eagle,suffix",
                   help="spec: speculation methods side by side (none: plain decoding)")
    g.add_argument("--temperatures", default="0,1",
                   help="spec: comma-separated sampling temperatures (0: greedy)")
    g.add_argument("--drafter", type=Path, default=None,
                   help="spec: drafter dir (default: drafter-eagle1 beside the policy, warmed up "
                        "if missing)")
    g.add_argument("--compile", action="store_true",
                   help="spec: torch.compile every method's steps (slow to warm up)")
    # On the 2-core CPU no swept shape (depth 4-9, topk 1-4, 6-20 nodes) beat this one reliably
    # across drafters, and it keeps the best greedy acceptance over 64 prompts (README).
    g.add_argument("--depth", type=int, default=6, help="spec: draft tree depth")
    g.add_argument("--topk", type=int, default=3, help="spec: children per draft tree node")
    g.add_argument("--tokens-to-verify", type=int, default=12,
                   help="spec: tree nodes verified per step")
    g = p.add_argument_group("gpu: real shapes, random weights, on a CUDA device")
    g.add_argument("--shape", default="qwen2.5-7b",
                   help="gpu: a real model shape with random weights (bench/real_shapes.py)")
    g.add_argument("--contexts", default="512,4096", help="gpu: decode context lengths")
    g.add_argument("--parts", default="generate,decode,cycle,memory,rows",
                   help="gpu: which measurements to run")
    g = p.add_argument_group("recipe: the recipe run twice, side by side")
    g.add_argument("--backends", default=None,
                   help="recipe: two rollout backends side by side instead of speculation off "
                        "/ on, e.g. native,vllm (vllm: from the vLLM venv, scripts/setup-vllm.sh)")
    g.add_argument("--paired-seeds", type=int, default=4,
                   help="recipe --backends native,vllm: seed sets each drafter (online, stale) "
                        "rolls out on the online run's policy every step besides the step's "
                        "own (one rollout's accept length is within a few percent only)")
    g = p.add_argument_group("cluster: Ray rollout workers, the drafter trained on idle time")
    g.add_argument("--seeds", type=int, default=1,
                   help="cluster: run the ray_off / ray_on pair with this many seeds (the "
                        "recipe's, then the next ones): exposed_drafter_cost is their mean")
    g.add_argument("--consolidate-below", type=int, default=16,
                   help="cluster: the tail-consolidation arm's cluster.consolidate_below (a "
                        "worker's tail of fewer requests moves to a generating worker)")
    g.add_argument("--gpu-json", type=Path, default=None,
                   help="cluster: unit costs for the projections from this `bench gpu --json` "
                        "file (default: the H100 floors of the README)")
    g.add_argument("--simulate", action="store_true",
                   help="cluster: only the simulator's projections (8 / 64 / 256 GPUs, 7B and "
                        "32B) from --gpu-json or the H100 floors; no runs")
    g = p.add_argument_group("hybrid: hybrid workers vs one process vs colocated Ray ranks")
    g.add_argument("--workers", type=int, default=2,
                   help="hybrid: hybrid workers (and the colocated arm's rollout workers)")
    g = p.add_argument_group("update: the actor's update, packed vs padded (--shape's vocabulary)")
    g.add_argument("--long-tokens", type=int, default=3000,
                   help="update: the long answer among --rows - 1 short ones (30-200 tokens)")
    g.add_argument("--rows", type=int, default=16, help="update: answers in the batch")
    g.add_argument("--micro-batch-tokens", type=int, default=8192,
                   help="update: actor.micro_batch_tokens")
    g.add_argument("--logits-chunk-tokens", type=int, default=4096,
                   help="update: actor.logits_chunk_tokens of the chunked arms")
    g.add_argument("--full-layers", action="store_true",
                   help="update: --shape's own layers (default: 4 layers of width 256, what a "
                        "CPU updates in seconds)")
    g = p.add_argument_group("kv: the paged KV cache's concurrency")
    g.add_argument("--trace", type=Path, default=None,
                   help="kv: a published answer-length trace for concurrency_ratio "
                        "(default: the bundled fastdraft/bench/traces/ one)")
    g.add_argument("--shapes-recipe", type=Path, default=Path("recipes/qwen3-8b-grpo.yaml"),
                   help="kv: the recipe whose shapes concurrency_ratio takes")


def run_bench(args: argparse.Namespace) -> int:
    """`fastdraft bench WHICH`: checks the arguments before any work, then runs one bench."""
    from fastdraft.bench.common import parse_dtype
    from fastdraft.demo import heldout_prompts, resolve_model
    from fastdraft.utils.device_memory import check_device_option
    from fastdraft.utils.outputs import check_output_file
    if args.json is not None:
        check_output_file(args.json, "json", "--json", overwrite=args.overwrite)
    check_device_option(args.device, "--device")
    dtype = parse_dtype(args.dtype)
    if args.which == "gpu":
        return _bench_gpu(args, dtype)
    if args.which == "update":
        return _bench_update(args)
    if args.which == "tp":
        from fastdraft.bench.tp_bench import TPBench, run_tp_bench
        sizes = _positive_ints(args.batch_sizes or "1,8", "--batch-sizes")
        if args.repeats < 1 or args.max_new_tokens < 1:
            raise FastdraftError("--repeats and --max-new-tokens must be >= 1")
        run_tp_bench(TPBench(batch_sizes=sizes, repeats=args.repeats,
                             new_tokens=min(args.max_new_tokens, 512)), args.json)
        return 0
    if args.which == "cluster" and args.simulate:
        from fastdraft.bench.projections import projection_lines, run_projections
        print("\n".join(projection_lines(run_projections(args.gpu_json, args.json))))
        return 0
    if args.simulate:
        raise FastdraftError("--simulate is for `bench cluster` (the cluster simulator)")
    if args.which in ("recipe", "drafter", "rollout", "cluster", "hybrid", "kv"):
        return _bench_from_recipe(args)
    sizes = args.batch_sizes or ("1,4,16" if args.which == "spec" else "1,16")
    batch_sizes = _positive_ints(sizes, "--batch-sizes")
    if args.repeats < 1 or args.num_prompts < 1 or args.max_new_tokens < 1:
        raise FastdraftError("--repeats, --num-prompts and --max-new-tokens must be >= 1")
    if args.which == "spec":  # checked before a drafter warm-up (minutes) can start
        from fastdraft.bench.spec_bench import METHODS
        if min(args.depth, args.topk, args.tokens_to_verify) < 1:
            raise FastdraftError(f"--depth, --topk and --tokens-to-verify must be >= 1, got "
                                 f"{args.depth}, {args.topk}, {args.tokens_to_verify}")
        unknown = set(args.methods.split(",")) - set(METHODS)
        if unknown:
            raise FastdraftError(f"--methods: unknown {sorted(unknown)}; choose from {METHODS}")
        for t in args.temperatures.split(","):
            try:
                value = float(t)
            except ValueError:
                raise FastdraftError(f"--temperatures takes comma-separated numbers, got "
                                     f"{args.temperatures!r}") from None
            if value < 0:
                raise FastdraftError(f"--temperatures: {t} < 0")
    model_dir = resolve_model(args.model, args.cache_dir)
    prompts = [ids for ids, _, _ in heldout_prompts(model_dir, args.num_prompts, seed=1)]
    print(f"{len(prompts)} held-out prompts, answers up to {args.max_new_tokens} tokens; each row "
          "rolls all of them out, batch_size at a time")
    if args.which == "spec":
        return _bench_spec(args, model_dir, prompts, batch_sizes, dtype)
    from fastdraft.bench.engine_bench import EngineBenchConfig, run_engine_bench
    run_engine_bench(EngineBenchConfig(model_dir=model_dir, prompts=prompts,
                                       batch_sizes=batch_sizes,
                                       max_new_tokens=args.max_new_tokens,
                                       repeats=args.repeats, compile=not args.no_compile,
                                       device=args.device, dtype=dtype),
                     args.json)
    return 0


def _bench_from_recipe(args: argparse.Namespace) -> int:
    """`bench recipe | drafter | rollout | cluster | hybrid | kv`: a recipe (default: the tiny
    one) and overrides."""
    from fastdraft.bench import (
        cluster_bench,
        drafter_bench,
        hybrid_bench,
        kv_bench,
        recipe_bench,
        rollout_bench,
    )
    module, run = {"recipe": (recipe_bench, recipe_bench.run_recipe_bench),
                   "drafter": (drafter_bench, drafter_bench.run_drafter_bench),
                   "rollout": (rollout_bench, rollout_bench.run_rollout_bench),
                   "cluster": (cluster_bench, cluster_bench.run_cluster_bench),
                   "hybrid": (hybrid_bench, hybrid_bench.run_hybrid_bench),
                   "kv": (kv_bench, kv_bench.run_kv_bench)}[args.which]
    recipe, overrides = Path("recipes/tiny-grpo.yaml"), list(args.recipe_args)
    if overrides and "=" not in overrides[0]:
        recipe, overrides = Path(overrides[0]), overrides[1:]
    extra = ({"rounds": args.repeats} if args.which == "rollout" else
             {"rounds": args.repeats, "trace": args.trace, "shapes_recipe": args.shapes_recipe}
             if args.which == "kv" else
             {"gpu_json": args.gpu_json, "consolidate_below": args.consolidate_below,
              "seeds": args.seeds}
             if args.which == "cluster" else
             {"workers": args.workers} if args.which == "hybrid" else
             {"backends": args.backends.split(",") if args.backends else None,
              "paired_seeds": args.paired_seeds}
             if args.which == "recipe" else {})
    out = run(recipe, overrides, args.out_dir or Path(f"runs/bench-{args.which}"),
              args.json, args.cache_dir, **extra)
    print("\n".join(module.summary_lines(out)))
    return 0


def _positive_ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise FastdraftError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise FastdraftError(f"{flag} must all be >= 1, got {text!r}")
    return values


def _bench_gpu(args: argparse.Namespace, dtype: torch.dtype | None) -> int:
    import torch

    from fastdraft.bench.gpu_bench import GpuBenchConfig, run_gpu_bench
    device = args.device if args.device != "cpu" else "cuda"
    cfg = GpuBenchConfig(shape=args.shape,
                         batch_sizes=_positive_ints(args.batch_sizes or "1,8,64",
                                                    "--batch-sizes"),
                         contexts=_positive_ints(args.contexts, "--contexts"),
                         repeats=args.repeats, compile=not args.no_compile, device=device,
                         dtype=dtype or torch.bfloat16)
    if not torch.cuda.is_available():
        raise FastdraftError("bench gpu needs a CUDA GPU (none is visible to torch here)")
    run_gpu_bench(cfg, args.json, parts=tuple(args.parts.split(",")))
    return 0


def _bench_update(args: argparse.Namespace) -> int:
    from fastdraft.bench.update_bench import UpdateBench, run_update_bench
    if min(args.long_tokens, args.rows, args.micro_batch_tokens, args.repeats) < 1:
        raise FastdraftError("--long-tokens, --rows, --micro-batch-tokens and --repeats must be "
                             ">= 1")
    narrow = {} if not args.full_layers else {"hidden": None, "layers": None}
    cfg = UpdateBench(shape=args.shape, rows=args.rows, long_tokens=args.long_tokens,
                      micro_batch_tokens=args.micro_batch_tokens,
                      chunk_tokens=args.logits_chunk_tokens, repeats=args.repeats,
                      device=args.device, **narrow,
                      dtype=args.dtype or ("bfloat16" if args.device.startswith("cuda")
                                           else "float32"))
    run_update_bench(cfg, args.json)
    return 0


def _bench_spec(args: argparse.Namespace, model_dir: Path, prompts: list[list[int]],
                batch_sizes: tuple[int, ...], dtype: torch.dtype | None) -> int:
    from fastdraft.bench.spec_bench import SpecBenchConfig, run_spec_bench
    from fastdraft.demo import ensure_drafter
    drafter = ensure_drafter(model_dir, args.drafter)
    cfg = SpecBenchConfig(model_dir=model_dir, drafter_dir=drafter, prompts=prompts,
                          batch_sizes=batch_sizes,
                          temperatures=tuple(float(t) for t in args.temperatures.split(",")),
                          methods=tuple(args.methods.split(",")), depth=args.depth,
                          topk=args.topk, tokens_to_verify=args.tokens_to_verify,
                          max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                          compile=args.compile, device=args.device,
                          dtype=dtype)
    run_spec_bench(cfg, args.json)
    return 0
