"""`fastdraft <command>`: run | plot | bootstrap | generate | drafter | bench. Each command
registers its arguments and its runner by name; the heavy imports happen inside the runner so
`--help` stays fast. User errors (errors.py: a FastdraftError, the lossless gate's among them, a
FileNotFoundError, an OS error on a chosen directory) print one line that says what to change; a
bug prints one line and leaves its traceback in a crash log."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from fastdraft.utils.outputs import check_output_dir, check_output_file

Runner = Callable[[argparse.Namespace], int]
COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Runner, str]] = {}


def command(name: str, help_text: str) -> Callable[[Callable], Callable]:
    def wrap(add_args: Callable[[argparse.ArgumentParser], None]) -> Callable:
        def register(runner: Runner) -> Runner:
            COMMANDS[name] = (add_args, runner, help_text)
            return runner
        return register
    return wrap


def _cache_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="bootstrap cache ($FASTDRAFT_CACHE, else ~/.cache/fastdraft)")


def _overwrite_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help=f"replace {what} even if fastdraft did not write it (without it, an "
                        "existing path is replaced only when it is fastdraft's own output of the "
                        "same kind, and never when it is an input of the command)")


def _bootstrap_args(p: argparse.ArgumentParser) -> None:
    _cache_arg(p)
    p.add_argument("--force", action="store_true", help="retrain even if a cached policy exists")
    p.add_argument("--seed", type=int, default=0,
                   help="training seed (each seed is its own cached policy)")
    p.add_argument("--spec", default="tiny",
                   help="named policy spec (fastdraft/bootstrap/spec.py): tiny (Qwen2, the tiny "
                        "recipe's) or tiny-qwen3 (Qwen3, head_dim 64)")
    _overwrite_arg(p, "the policy's directory in the cache")


@command("bootstrap", "train (once, cached) a tiny CPU policy on the synthetic long-tail task")(
    _bootstrap_args)
def run_bootstrap_cmd(args: argparse.Namespace) -> int:
    from fastdraft.bootstrap.run import run_bootstrap
    report = run_bootstrap(args.cache_dir, force=args.force, seed=args.seed, spec=args.spec,
                           overwrite=args.overwrite)
    print(f"policy: {report.policy_dir}")
    print(f"  train {report.train_seconds:.0f}s, total {report.total_seconds:.0f}s, "
          f"{report.num_params:,} params")
    print(f"  held-out accuracy: greedy {report.heldout_accuracy_greedy:.1%}, "
          f"sampled(T=1) {report.heldout_accuracy_sampled:.1%} over {report.num_heldout}")
    print(f"  answer length p50/p90/p99 (tokens): greedy {report.greedy_length_p50:.0f}/"
          f"{report.greedy_length_p90:.0f}/{report.greedy_length_p99:.0f}, sampled "
          f"{report.sampled_length_p50:.0f}/{report.sampled_length_p90:.0f}/"
          f"{report.sampled_length_p99:.0f}")
    return 0


def _generate_args(p: argparse.ArgumentParser) -> None:
    _cache_arg(p)
    p.add_argument("--model", type=Path, default=None,
                   help="HF checkpoint dir (default: the bootstrap policy, trained if missing)")
    p.add_argument("--prompts", type=Path, default=None,
                   help="local JSONL/parquet with a 'prompt' column (default: task prompts)")
    p.add_argument("--num-prompts", type=int, default=16, help="prompts to roll out")
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--max-new-tokens", type=int, default=160, help="answer budget per prompt")
    p.add_argument("--seed", type=int, default=0,
                   help="picks the held-out task prompts and the sampling streams")


@command("generate", "roll out prompts with RolloutEngine (default: the bootstrap demo)")(
    _generate_args)
def run_generate_cmd(args: argparse.Namespace) -> int:
    from fastdraft.demo import generate_demo
    return generate_demo(args)


def _bench_args(p: argparse.ArgumentParser) -> None:
    from fastdraft.bench.command import add_bench_args
    add_bench_args(p)
    _cache_arg(p)


@command("bench", "side-by-side benchmarks that print a table and write JSON")(_bench_args)
def run_bench_cmd(args: argparse.Namespace) -> int:
    from fastdraft.bench.command import run_bench
    return run_bench(args)


def _drafter_args(p: argparse.ArgumentParser) -> None:
    from fastdraft.run.drafter_command import add_drafter_args
    add_drafter_args(p)
    _cache_arg(p)
    _overwrite_arg(p, "--out and --work-dir")


@command("drafter", "train a drafter for a policy (offline warm-up)")(_drafter_args)
def run_drafter_cmd(args: argparse.Namespace) -> int:
    from fastdraft.run.drafter_command import run_drafter
    return run_drafter(args)


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", type=Path, nargs="?", default=None,
                   help="a YAML recipe (bundled: recipes/*.yaml)")
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. actor.lr=3e-6 "
                   "rollout.spec.method=none")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="where metrics, checkpoints and the dashboard go (default: runs/NAME)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --run-dir from its newest complete checkpoint")
    p.add_argument("--resume-force", action="store_true",
                   help="--resume even if the recipe changes what the run learns (lr, data, "
                        "algorithm, ...); without it such a resume is refused")
    p.add_argument("--dry-run", action="store_true",
                   help="parse, check the paths and print the engine's, actor's and run's memory "
                        "plans (config.json only: no weights); exit 0 if they fit")
    p.add_argument("--device-memory-gb", type=float, default=None,
                   help="--dry-run: each of the node's actor.num_ranks devices, decimal GB "
                        "(default: this GPU's, else 80 for a cuda recipe; the RAM for a cpu one)")
    p.add_argument("--json", type=Path, default=None, help="--dry-run: also write the plans here")
    _overwrite_arg(p, "--run-dir's files (and --json)")
    _cache_arg(p)


@command("run", "train a policy with GRPO on (speculative) rollouts, as a recipe says")(_run_args)
def run_recipe_cmd(args: argparse.Namespace) -> int:
    from fastdraft.config import load_recipe
    from fastdraft.errors import FastdraftError
    from fastdraft.run.run import run_recipe
    if args.recipe is None:
        raise FastdraftError("name a recipe: fastdraft run RECIPE.yaml [section.key=value ...] "
                             "(bundled ones are in recipes/, e.g. recipes/tiny-grpo.yaml)")
    cfg = load_recipe(args.recipe, args.overrides)
    if args.json is not None:
        check_output_file(args.json, "json", "--json", [("the recipe", args.recipe)],
                          args.overwrite)
    run_dir = args.run_dir or Path("runs") / cfg.name
    if args.dry_run:   # the run's checks of its run dir too (nothing created or taken there)
        from fastdraft.run.dry_run import dry_run
        return dry_run(cfg, args.device_memory_gb, args.json, args.cache_dir, run_dir,
                       resume=args.resume, resume_force=args.resume_force,
                       overwrite=args.overwrite)
    from fastdraft.run.stop import RunStopped
    args.run_dir = run_dir   # main() names it in errors
    try:
        run_recipe(cfg, args.run_dir, resume=args.resume or args.resume_force,
                   cache_dir=args.cache_dir, resume_force=args.resume_force,
                   overwrite=args.overwrite)
    except RunStopped as stopped:
        how = " (the newest checkpoint; the step under way abandoned)" if stopped.abandoned else ""
        print(f"fastdraft: {signal.Signals(stopped.signum).name}: stopped at step {stopped.step}"
              f"{how}; {_restart_hint(args)}", file=sys.stderr)
        return stopped.exit_code
    print(f"run directory: {args.run_dir} (metrics.jsonl, dashboard.png, checkpoints/, wandb/)")
    return 0


def _restart_hint(args: argparse.Namespace) -> str:
    """How to go on with an interrupted `run`: --resume from its newest checkpoint, or start
    again when it has none."""
    from fastdraft.checkpoint.layout import CorruptCheckpointError, step_dirs, validate

    def whole(path: Path) -> bool:   # a damaged one is no checkpoint to resume from
        try:
            return validate(path) is not None
        except CorruptCheckpointError:
            return False
    has_checkpoint = any(whole(path) for _, path in step_dirs(args.run_dir / "checkpoints"))
    command = ["fastdraft", "run", str(args.recipe), *args.overrides, "--run-dir",
               str(args.run_dir), *(["--resume"] if has_checkpoint else [])]
    return (("resume with: " if has_checkpoint else "no checkpoint yet; start it again: ")
            + shlex.join(command))


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", type=Path, required=True,
                   help="a run directory (its drafter/ and newest checkpoint's policy)")
    p.add_argument("--format", choices=["sglang", "vllm", "speculators", "all", "both"],
                   default="all", help="sglang: the SpecForge/SGLang layout; speculators (EAGLE-3;"
                   " also `vllm`): vLLM's own; EAGLE-1: sglang / vllm; all or both: every layout")
    p.add_argument("--speculative-tokens", type=int, default=3,
                   help="speculators layout: the draft length `vllm serve DIR` uses")
    p.add_argument("--out", type=Path, default=None, help="default: RUN/export")
    _overwrite_arg(p, "--out's layout directories")


@command("export", "write a run's drafter as SGLang / vLLM load it (checked before success)")(
    _export_args)
def export_cmd(args: argparse.Namespace) -> int:
    from fastdraft.checkpoint import CheckpointManager
    from fastdraft.checkpoint.sharded import policy_weights
    from fastdraft.export import export_drafter
    drafter = args.run / "drafter"
    if not (drafter / "drafter_config.json").is_file():
        raise FileNotFoundError(f"{drafter}: no drafter there; `fastdraft run` saves the run's "
                                "drafter there at its end (speculative recipes only)")
    out = args.out or args.run / "export"
    check_output_dir(out, "export", "--out", [("--run", args.run)], args.overwrite)
    with _run_dir_lock_for(out, args.run, "--run"):   # not while a run writes there
        latest = CheckpointManager(args.run, keep=1).latest()
        if latest is None:
            raise FileNotFoundError(f"{args.run / 'checkpoints'}: no complete checkpoint to "
                                    "read the policy from")
        with policy_weights(latest) as policy:   # a sharded checkpoint's: consolidated
            for path in export_drafter(drafter, policy, out, args.format,
                                       verifier=str(latest.resolve()),
                                       speculative_tokens=args.speculative_tokens,
                                       overwrite=args.overwrite):
                print(f"exported: {path}")
    return 0


def _run_dir_lock_for(out: Path, run_dir: Path, setting: str):
    """run_dir's lock while writing `out` inside it (a live run there is named, not raced);
    nothing to hold when `out` lies elsewhere."""
    from contextlib import nullcontext

    from fastdraft.run.run_dir import RunDirLock
    inside = run_dir.resolve() in [out.resolve(), *out.resolve().parents]
    return RunDirLock.claim(run_dir, setting, create=False) if inside else nullcontext()


def _plot_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, help="a run directory (with metrics.jsonl)")
    p.add_argument("--out", type=Path, default=None, help="default: RUN_DIR/dashboard.png")
    p.add_argument("--reference", type=Path, default=None, metavar="RUN_DIR",
                   help="a plain-decoding run of the same recipe, drawn dashed beside this one "
                        "(e.g. `fastdraft bench recipe`'s OUT/off)")
    _overwrite_arg(p, "--out")


@command("plot", "redraw a run's dashboard PNG from its metrics.jsonl")(_plot_args)
def plot_cmd(args: argparse.Namespace) -> int:
    from fastdraft.observability.dashboard import DASHBOARD_FILE, draw_dashboard
    out = args.out or args.run_dir / DASHBOARD_FILE
    check_output_file(out, "png", "--out", [("RUN_DIR", args.run_dir),
                                             ("--reference", args.reference)], args.overwrite)
    with _run_dir_lock_for(out, args.run_dir, "RUN_DIR"):
        print(f"dashboard: {draw_dashboard(args.run_dir, out, args.reference)}")
    return 0


def _one_line_warnings() -> None:
    """fastdraft's own warnings (a skipped checkpoint, ...) as one line each: the message says
    what happened and what to do; the source line of the warn() call says nothing to a user."""
    default = warnings.formatwarning
    if getattr(default, "fastdraft", False):
        return

    def format_warning(message, category, filename, lineno, line=None):
        if category.__module__.startswith("fastdraft."):
            return f"fastdraft: warning: {message}\n"
        return default(message, category, filename, lineno, line)
    format_warning.fastdraft = True   # type: ignore[attr-defined]
    warnings.formatwarning = format_warning


def main(argv: list[str] | None = None) -> int:
    _one_line_warnings()
    parser = argparse.ArgumentParser(
        prog="fastdraft",
        description="fastdraft: lossless speculative rollouts for RL post-training")
    from fastdraft import __version__
    parser.add_argument("--version", action="version", version=f"fastdraft {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_args, _, help_text) in COMMANDS.items():
        add_args(sub.add_parser(name, help=help_text, description=help_text))
    args, extra = parser.parse_known_args(argv)
    # Overrides may also follow the options (`run R --run-dir D actor.lr=1e-4`).
    trailing = next((n for n in ("overrides", "recipe_args") if hasattr(args, n)), None)
    if extra and trailing and all("=" in e and e[0] != "-" for e in extra):
        setattr(args, trailing, [*getattr(args, trailing), *extra])
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from fastdraft.utils.stop_signals import carry_out, interrupt_on_stop_signals, stop_signal_in
    interrupt_on_stop_signals()   # and, a stop under way, further ones noted, not raised
    start = time.perf_counter()
    try:
        _check_cache_dir(getattr(args, "cache_dir", None))
        code = COMMANDS[args.command][1](args)
    except BaseException as err:   # every failure ends in one line
        signum = stop_signal_in(err)   # a stop before a run's steps, or in another command
        if signum is not None:
            carry_out(signum)   # the exit (Ray's atexit shutdown among it) is not cut short
            hint = f"; {_restart_hint(args)}" if args.command == "run" and args.run_dir else ""
            print(f"fastdraft {args.command}: stopped by {signal.Signals(signum).name}{hint}",
                  file=sys.stderr)
            return 128 + signum
        if not isinstance(err, Exception):   # SystemExit
            raise
        return _report_failure(args, err)
    print(f"[fastdraft {args.command}: {time.perf_counter() - start:.1f}s]", file=sys.stderr)
    return code


def _check_cache_dir(cache: Path | None) -> None:
    from fastdraft.errors import FastdraftError
    if cache is not None and cache.exists() and not cache.is_dir():
        raise FastdraftError(f"--cache-dir {cache} is a file: name a directory (the bootstrap "
                             "cache: policies and drafters fastdraft trains once)")


def _report_failure(args: argparse.Namespace, err: Exception) -> int:
    """A user error (errors.py): one line that says what to change, exit 2. Anything else is a
    bug: one line, the traceback in a crash log (the run directory's, else the cache's), exit 1."""
    from fastdraft.bootstrap.run import default_cache_dir
    from fastdraft.errors import Place, os_error_in, user_error_line, write_crash_log
    cache = getattr(args, "cache_dir", None) or default_cache_dir()
    chosen = [(flag, getattr(args, flag[2:].replace("-", "_"), None))
              for flag in ("--run-dir", "--out-dir", "--out", "--run")]
    places = sorted((Place(Path(path), flag) for flag, path in
                     [*chosen, ("--cache-dir ($FASTDRAFT_CACHE)", cache)] if path is not None),
                    key=lambda place: -len(place.path.resolve().parts))   # the deepest names it
    line = user_error_line(err, places)
    if line is not None:
        if args.command == "run" and getattr(args, "run_dir", None) and os_error_in(err):
            line += f"; {_restart_hint(args)}"   # a full disk mid-run loses no checkpoint
        print(f"fastdraft {args.command}: error: {line}", file=sys.stderr)
        return 2
    # The run's directory first (--out may name a file: not there).
    log = write_crash_log(err, [Path(path) for flag, path in chosen
                                if path is not None and flag != "--out"] + [Path(cache)])
    where = (f"the traceback is in {log}" if log is not None
             else "no crash log could be written: the traceback follows")
    print(f"fastdraft {args.command}: unexpected error (a bug in fastdraft; please report it "
          f"with the crash log): {type(err).__name__}: {err}; {where}", file=sys.stderr)
    if log is None:
        import traceback
        traceback.print_exception(err)
    return 1

if __name__ == "__main__":
    sys.exit(main())
