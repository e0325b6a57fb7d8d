"""`fastdraft generate`: the quick start's generation demo over the bootstrap policy, or any HF
checkpoint + local prompt file."""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import AutoTokenizer

from fastdraft.engine import FinishReason, RolloutEngine, SamplingParams
from fastdraft.errors import FastdraftError

if TYPE_CHECKING:
    from fastdraft.drafter.warmup import WarmupConfig
from fastdraft.data.tasks import Problem, get_task
from fastdraft.data.tasks.modsum import ANSWER_MARKER, ModSumTask, extract_answer, make_problem

HELDOUT_SEED_OFFSET = 10_000  # demo/bench prompts come from seeds the bootstrap never trains on


def resolve_model(model: Path | None, cache_dir: Path | None, flag: str = "--model") -> Path:
    """An explicit checkpoint dir, else the bootstrap policy (trained and cached if missing).
    flag: the option the user gave the directory with (named in the error)."""
    if model is not None:
        if not (model / "config.json").is_file():
            raise FileNotFoundError(f"{model}/config.json not found: {flag} takes an HF "
                                    "checkpoint directory")
        from fastdraft.errors import FastdraftError
        from fastdraft.models import ModelConfig
        try:   # an architecture fastdraft does not run is the first thing to say
            ModelConfig.from_pretrained(model)
        except (ValueError, KeyError) as err:
            raise FastdraftError(f"{flag} {model}: {err}") from None
        return model
    from fastdraft.bootstrap.run import run_bootstrap
    return run_bootstrap(cache_dir).policy_dir


#: Marks a default drafter that ensure_drafter warmed up by itself (free to replace when stale).
AUTO_WARMED = "auto_warmed"


def default_drafter_dir(policy_dir: Path, kind: str) -> Path:
    return policy_dir.parent / f"drafter-{kind}"


def ensure_drafter(policy_dir: Path, drafter_dir: Path | None, kind: str = "eagle1",
                   warmup: WarmupConfig | None = None) -> Path:
    """An explicit drafter dir, else the default one beside the policy: warmed up if missing, and
    warmed up again if fastdraft warmed it up itself with other settings than today's defaults
    (a bench must not measure an outdated drafter silently). One that `fastdraft drafter warmup`
    put there with the user's own settings is used as it is, never overwritten.
    warmup: other settings than the defaults (a recipe's short warm-up): cached in a directory
    of their own, named by their digest."""
    if drafter_dir is not None:
        return drafter_dir
    from fastdraft.drafter.warmup import WarmupConfig, warmup_drafter
    cfg = warmup or WarmupConfig(kind=kind)
    out = default_drafter_dir(policy_dir, cfg.kind)
    if cfg != WarmupConfig(kind=cfg.kind):
        digest = hashlib.sha256(json.dumps(asdict(cfg), sort_keys=True).encode()).hexdigest()
        out = out.with_name(f"{out.name}-{digest[:10]}")
    config_file = out / "drafter_config.json"
    if config_file.is_file():
        meta = json.loads(config_file.read_text())
        if meta.get("warmup") == asdict(cfg):
            return out
        if not meta.get(AUTO_WARMED):
            print(f"using the drafter at {out}, warmed up with settings other than today's "
                  "defaults (not by fastdraft on its own); pass --drafter DIR for another one, "
                  "or delete it to warm up a default one")
            return out
        print(f"the drafter at {out} was warmed up with other settings than the current "
              "defaults: warming up a new one")
    else:
        print(f"no drafter at {out}: warming one up (offline, on the policy's rollouts)")
    warmup_drafter(policy_dir, out, prompt_ids(policy_dir, None, cfg.num_rollouts,
                                               heldout=False), cfg, meta={AUTO_WARMED: True})
    return out


def prompt_ids(model_dir: Path, prompts_file: Path | None, n: int, seed: int = 0,
               heldout: bool = True, prompt_key: str = "prompt") -> list[list[int]]:
    """Up to n prompts as token ids: from a local JSONL/parquet file's prompt_key column, else
    task problems."""
    if prompts_file is None:
        return [ids for ids, _, _ in heldout_prompts(model_dir, n, seed, heldout)]
    from fastdraft.data.files import load_prompts
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer.encode(r["prompt"], add_special_tokens=False)
            for r in load_prompts(prompts_file, prompt_key)[:n]]


def heldout_prompts(model_dir: Path, n: int, seed: int = 0, heldout: bool = True
                    ) -> list[tuple[list[int], str, Problem]]:
    """n task problems as (token ids, prompt text, problem) with the policy's own tokenizer;
    heldout=False draws from the training seeds instead (drafter warm-up data)."""
    from fastdraft.bootstrap.policy import encode_prompt
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random((HELDOUT_SEED_OFFSET if heldout else 0) + seed)
    task = get_task("modsum")
    problems = [task.sample(rng) for _ in range(n)]
    return [(encode_prompt(tokenizer, p.prompt), p.prompt, p) for p in problems]


#: The default prompts' verdicts, as generate_demo prints them in front of each sample.
VERDICTS = ("correct", "wrong", "unfinished")


def verdict(task: ModSumTask, problem: Problem, completion: str, finish_reason: str) -> str:
    """correct: the task's verifier accepts the final answer; unfinished: max_new_tokens ran
    out before any answer; wrong: any other answer, or none before the end of the text."""
    if task.reward(problem, completion) == 1.0:
        return "correct"
    if finish_reason == FinishReason.LENGTH and extract_answer(completion) is None:
        return "unfinished"
    return "wrong"


def demo_header(task: ModSumTask, num_prompts: int, prompts_file: Path | None, bootstrap: bool,
                max_new_tokens: int) -> list[str]:
    """What the samples below are, so a column of "wrong" reads as the expected start of RL,
    not as a broken install."""
    if prompts_file is not None:
        return [f"prompts: the first {num_prompts} of {prompts_file}; no verdicts: a prompt file "
                "has no verifier (only the built-in task's prompts carry a checkable answer)"]
    example = make_problem([7, 3, 9, 4])
    lines = [f"prompts: {num_prompts} held-out problems of {task.name}, the bootstrap's synthetic "
             f"task: the digits' running sum mod 10 (\"{example.prompt}\" -> "
             f"\"{example.solution}\"), mostly a few terms, a few up to {task.max_terms} (a long "
             "tail of answer lengths)"]
    if bootstrap:
        lines.append(f"policy: the tiny bootstrap policy, weak at {task.name} by design (right "
                     "mostly on short problems); RL raises the reward: "
                     "`fastdraft run recipes/tiny-grpo.yaml`")
    lines.append(f"verdict: correct = right final answer (after '{ANSWER_MARKER}'); wrong = a "
                 "wrong one, or none; unfinished = no answer within --max-new-tokens "
                 f"({max_new_tokens})")
    return lines


def generate_demo(args: argparse.Namespace) -> int:
    if args.num_prompts < 1 or args.max_new_tokens < 1:   # before the policy loads
        raise FastdraftError(f"--num-prompts and --max-new-tokens must be >= 1, got "
                             f"{args.num_prompts} and {args.max_new_tokens}")
    SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                   max_new_tokens=args.max_new_tokens)   # its checks, before any work
    model_dir = resolve_model(args.model, args.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = get_task("modsum")
    if args.prompts is not None:
        from fastdraft.data.files import load_prompts
        rows = load_prompts(args.prompts)[: args.num_prompts]
        items = [(tokenizer.encode(r["prompt"], add_special_tokens=False), r["prompt"], None)
                 for r in rows]
    else:
        items = heldout_prompts(model_dir, args.num_prompts, args.seed)
    max_prompt = max(len(ids) for ids, _, _ in items)
    engine = RolloutEngine(model_dir, max_batch_size=min(64, len(items)),
                           max_seq_len=max_prompt + args.max_new_tokens + 1)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            max_new_tokens=args.max_new_tokens)
    start = time.perf_counter()
    outs = engine.generate([ids for ids, _, _ in items], params)
    elapsed = time.perf_counter() - start
    print("\n".join(demo_header(task, len(items), args.prompts, args.model is None,
                                args.max_new_tokens)))
    rewards, verdicts = [], []
    width = max(map(len, VERDICTS))
    for (_, text, problem), out in zip(items, outs):
        answer = tokenizer.decode(out.token_ids, skip_special_tokens=True)
        mark = ""
        if problem is not None:
            rewards.append(task.reward(problem, answer))
            verdicts.append(verdict(task, problem, answer, out.finish_reason))
            mark = f"{verdicts[-1]:<{width}} "
        print(f"{mark}{text}{answer}  [{len(out.token_ids)} tok, {out.finish_reason}]")
    num_tokens = sum(len(o.token_ids) for o in outs)
    lengths = sorted(len(o.token_ids) for o in outs)
    print(f"{len(outs)} completions, {num_tokens} tokens in {elapsed:.2f}s "
          f"({num_tokens / elapsed:.0f} tok/s); answer length median {lengths[len(lengths) // 2]}, "
          f"max {lengths[-1]}")
    if verdicts:
        counts = ", ".join(f"{verdicts.count(v)} {v}" for v in VERDICTS)
        print(f"verdicts: {counts}; reward mean {sum(rewards) / len(rewards):.2f} "
              f"(T={args.temperature})")
    return 0
