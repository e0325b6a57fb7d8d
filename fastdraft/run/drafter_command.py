"""`fastdraft drafter warmup | import`: its options and what it runs. cli.py registers it;
torch and the warm-up load inside run_drafter so `--help` stays fast."""

from __future__ import annotations

import argparse
from pathlib import Path

from fastdraft.utils.outputs import check_output_dir


def add_drafter_args(p: argparse.ArgumentParser) -> None:
    """The command's own options (cli.py adds --cache-dir and --overwrite)."""
    p.add_argument("action", choices=["warmup", "import"],
                   help="warmup: train offline on policy rollouts; import: a SpecForge/SGLang "
                        "or speculators EAGLE-3 directory (--source) as a fastdraft drafter")
    p.add_argument("--source", type=Path, default=None,
                   help="import: the engine directory (config.json + model.safetensors)")
    p.add_argument("--policy", type=Path, default=None, help="default: the bootstrap policy")
    p.add_argument("--out", type=Path, default=None,
                   help="drafter dir (default: drafter-<kind> beside the policy)")
    p.add_argument("--prompts", type=Path, default=None,
                   help="local JSONL/parquet with a 'prompt' column (default: task prompts)")
    p.add_argument("--kind", default="eagle1", help="eagle1 | eagle3")
    p.add_argument("--num-rollouts", type=int, default=None, help="default: 2048")
    p.add_argument("--steps", type=int, default=None, help="default: 4000")
    p.add_argument("--ttt-steps", type=int, default=None,
                   help="unrolled training steps (default: eagle1 2, eagle3 3)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="draft over the N most frequent answer tokens only (default: all)")
    p.add_argument("--seed", type=int, default=0, help="rollout and training seed")
    p.add_argument("--prompt-key", default="prompt", help="--prompts: the prompt column")
    p.add_argument("--recipe", type=Path, default=None,
                   help="the prompts of this recipe's data, tokenized as its run does (and its "
                        "policy, without --policy)")
    p.add_argument("--device", default="cpu",
                   help="where the engine generates and captures and the drafter trains "
                        "(cpu, cuda, cuda:N)")
    p.add_argument("--workers", type=int, default=1,
                   help="data-parallel members, each serving its share of the rollouts and "
                        "training (this process and Ray actors; on cuda a GPU each)")
    p.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default=None,
                   help="the training forward/backward (fp32 masters either way; default: "
                        "bfloat16 on cuda, float32 on the CPU)")
    p.add_argument("--token-budget", type=int, default=4096,
                   help="tokens per packed micro-batch of each member")
    p.add_argument("--init", type=Path, default=None,
                   help="start from this drafter (fastdraft, SpecForge/SGLang or speculators "
                        "directory) instead of a fresh one")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="captured rollouts and trainer state (default: OUT.warmup)")
    p.add_argument("--resume", action="store_true",
                   help="continue a killed warm-up from its --work-dir")
    p.add_argument("--save-every", type=int, default=50,
                   help="micro-steps between trainer state saves (what --resume continues from)")


def run_drafter(args: argparse.Namespace) -> int:
    """warmup: the policy's rollouts captured and a drafter trained on them (its settings, the
    device and the outputs checked before any work); import: an engine directory as a
    fastdraft drafter."""
    from fastdraft.demo import default_drafter_dir, prompt_ids, resolve_model
    from fastdraft.drafter.warmup import WarmupConfig
    recipe = None
    if args.recipe is not None:
        from fastdraft.config import load_recipe
        from fastdraft.errors import FastdraftError
        from fastdraft.run.inputs import resolve_policy
        if args.prompts is not None:
            raise FastdraftError("--prompts and --recipe both name the prompts: give one")
        recipe = load_recipe(args.recipe)
    if args.action == "warmup":   # its settings checked before a policy is bootstrapped
        given = {"num_rollouts": args.num_rollouts, "steps": args.steps,
                 "draft_vocab": args.draft_vocab}
        cfg = WarmupConfig.for_steps(kind=args.kind, seed=args.seed, ttt_steps=args.ttt_steps,
                                     **{k: v for k, v in given.items() if v is not None})
        plan = _device_plan(args)
    policy = (resolve_policy(recipe, args.cache_dir) if recipe is not None and args.policy is None
              else resolve_model(args.policy, args.cache_dir, flag="--policy"))
    inputs = [("--policy", policy), ("--source", args.source), ("--prompts", args.prompts),
              ("--recipe", args.recipe), ("--init", args.init)]
    if args.action == "import":
        return _import_drafter(args.source, policy, args.out, inputs, args.overwrite)
    out = args.out or default_drafter_dir(policy, args.kind)
    check_output_dir(out, "drafter", "--out", inputs, args.overwrite)
    work = args.work_dir or out.absolute().with_name(out.absolute().name + ".warmup")
    if not args.resume:
        check_output_dir(work, "warmup", "--work-dir", [*inputs, ("--out", out)], args.overwrite)
    if recipe is not None:
        from fastdraft.run.inputs import recipe_prompts
        prompts = recipe_prompts(recipe, policy, cfg.num_rollouts)
    else:
        prompts = prompt_ids(policy, args.prompts, cfg.num_rollouts, seed=args.seed,
                             heldout=False, prompt_key=args.prompt_key)
    report = _device_warmup(args, policy, out, work, prompts, cfg, plan)
    capture_rate = report.captured_tokens / max(report.rollout_seconds, 1e-9)
    train_rate = report.train_tokens / max(report.train_seconds, 1e-9)
    print(f"drafter: {report.drafter_dir} ({report.kind}); {report.num_rollouts} rollouts, "
          f"{report.captured_tokens:,} tokens generated and captured in "
          f"{report.rollout_seconds:.1f}s ({capture_rate:,.0f} tok/s); {report.train_tokens:,} "
          f"tokens trained in {report.train_seconds:.1f}s ({train_rate:,.0f} tok/s); final loss "
          f"{report.final_loss:.4f}, top-1 agreement with the policy {report.final_top1_acc:.1%}")
    return 0


def _device_plan(args: argparse.Namespace):
    import torch

    from fastdraft.run.device_warmup import DevicePlan
    from fastdraft.utils.device_memory import check_device_option
    check_device_option(args.device, "--device")
    cuda = args.device.startswith("cuda")
    return DevicePlan(device=args.device, workers=args.workers, token_budget=args.token_budget,
                      save_every=args.save_every,
                      dtype=torch.bfloat16 if cuda else torch.float32,
                      compute_dtype=args.compute_dtype or ("bfloat16" if cuda else "float32"))


def _device_warmup(args: argparse.Namespace, policy: Path, out: Path, work: Path, prompts, cfg,
                   plan):
    from fastdraft.run.device_warmup import device_warmup
    init = args.init
    if init is not None:
        from fastdraft.export.imports import engine_layout, import_drafter
        if engine_layout(init) is not None:
            work = work.absolute()
            init = import_drafter(init, policy, work.with_name(work.name + ".init"))
    return device_warmup(policy, out, prompts, cfg, plan, work, init=init, resume=args.resume,
                         overwrite=args.overwrite)


def _import_drafter(source: Path | None, policy: Path, out: Path | None, inputs,
                    overwrite: bool) -> int:
    from fastdraft.errors import FastdraftError
    from fastdraft.export.imports import engine_layout, import_drafter
    if source is None or out is None:
        raise FastdraftError("drafter import needs --source DIR (the engine directory) and --out "
                             "DIR (where the fastdraft drafter goes)")
    check_output_dir(out, "drafter", "--out", inputs, overwrite)
    import_drafter(source, policy, out, overwrite)
    print(f"drafter: {out} (imported from the {engine_layout(source)} layout at {source}); run "
          f"with drafter.path={out}")
    return 0
