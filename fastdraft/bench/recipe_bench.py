"""`fastdraft bench recipe`: a recipe run twice side by side, speculation off and on, same seeds,
steps interleaved (off step 0, on step 0, off step 1, ...) so machine drift hits both alike.
With `--backends native,vllm` the arms are the rollout backends instead, both speculating
(fastdraft's engine, vLLM), plus `vllm_stale`: vLLM with the drafter the run starts from and no
online training, so the online drafter's accept length inside vLLM has its baseline beside it,
step by step; the ratios and the law check then compare vllm against native. The two runs
train apart (vLLM's speculative samples depend on the drafter), so each step the stale arm's
engine also rolls out the online arm's next step on the online arm's policy (same prompts,
same seeds; `paired_stale`), then gets its own policy back: the online drafter against the
stale one on one policy, step by step. One rollout of 256 samples puts a drafter's accept
length within a few percent (which answers were drawn moves it as much as the drafter does),
so both drafters also roll out `paired_seeds` more seed sets of the step's prompts on that
policy (seeds no training step draws from), and the step's comparison is over all of them.

Reports the total rollout time ratio (`rollout_time_ratio` = on / off), the step time ratio,
the rollout share of each, and both reward curves. How the rewards are compared:

* The law (`law_check`): after training, both engines load the off run's final policy and roll
  it out on the first step's prompts with `law_seeds` seeds that training never used. Lossless
  speculation means both draw from one law, so the mean reward and mean answer length differ
  by sampling noise only: the bench reports the differences with a 95% interval over seeds
  (Welch; each seed's mean over the step's samples is one observation), and 0 belongs inside.
* The curves: after step 0 each run trains on its own draws, so the two curves are two
  trajectories of one stochastic process, not paired samples; a step's difference carries the
  whole history of both. They are compared by each run's first-5 -> last-5 rise and the mean
  over all steps, not by a per-step test.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastdraft.bench.common import fresh_run_dirs, write_json
from fastdraft.config import load_recipe
from fastdraft.config.sections.rollout import ROLLOUT_BACKENDS
from fastdraft.errors import FastdraftError
from fastdraft.run.loop import rollout, train_step
from fastdraft.run.run import Run


def run_recipe_bench(recipe: Path, overrides: list[str], out_dir: Path,
                     json_path: Path | None = None, cache_dir: Path | None = None,
                     law_seeds: int = 8, backends: list[str] | None = None,
                     paired_seeds: int = 4) -> dict[str, Any]:
    base = load_recipe(recipe, overrides)
    if not base.rollout.spec.enabled:
        raise FastdraftError(f"{recipe} does not speculate (rollout.spec.method=none): nothing to "
                             "compare; set rollout.spec.method")
    if base.actor.num_ranks > 1:   # each actor's rank 0 holds this process's default group
        raise FastdraftError(f"bench recipe runs its arms' actors in one process: a sharded actor "
                             f"(actor.num_ranks={base.actor.num_ranks}) cannot be one of several "
                             f"there; add actor.num_ranks=1 (what is compared is the rollout)")
    if paired_seeds < 0:
        raise FastdraftError(f"--paired-seeds must be >= 0, got {paired_seeds}")
    quiet = ["logging.wandb.mode=disabled", "logging.progress=false", "logging.dashboard=false"]
    arms = _arms(base.rollout.spec.method, base.drafter.online.enabled, backends)
    runs: dict[str, Run] = {}
    for name, run_dir in fresh_run_dirs(out_dir, arms).items():
        arm = arms[name]
        runs[name] = Run(load_recipe(recipe, [*overrides, *quiet, *arm]), run_dir,
                         cache_dir=cache_dir)
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    # On the online run's policy, steps 1..N-1: each drafter's accept length per seed set
    paired: dict[str, list[list[float]]] = {"stale": [], "online": []}
    num_steps = base.algorithm.num_steps
    for step in range(num_steps):
        for name, run in runs.items():
            rows[name].append(train_step(run, step))
            print(f"step {step + 1}/{num_steps} {name}: reward "
                  f"{rows[name][-1]['reward/mean']:.3f} rollout "
                  f"{rows[name][-1]['rollout/time_s']:.2f}s", flush=True)
        if "vllm_stale" in runs and step + 1 < num_steps:
            # past the law check's seeds (num_steps + i): seeds no training step drew from
            extra = [num_steps + law_seeds + (step + 1) * paired_seeds + i
                     for i in range(paired_seeds)]
            paired["stale"].append(paired_accept(runs["vllm"], runs["vllm_stale"], step + 1,
                                                 extra))
            paired["online"].append(eval_accept(runs["vllm"], step + 1, extra))
    ref, other = list(runs)[:2]   # off / on, or native / vllm
    law = law_check(runs, base.rollout.prompts_per_step, law_seeds, ref, other)
    for run in runs.values():
        run.finish()
    samples = base.rollout.prompts_per_step * base.rollout.group_size
    payload = {**_summary(rows, ref, other), "law_check": law, "arms": arms}
    if paired["stale"]:
        payload["paired_stale"] = _paired_summary(payload["vllm"]["accept_length"][1:],
                                                  paired["online"], paired["stale"])
    payload.update(recipe=str(recipe), overrides=overrides, num_steps=base.algorithm.num_steps,
                   samples_per_step=samples, plot=str(_plot(rows, out_dir / "recipe_bench.png")))
    if json_path is not None:
        write_json(json_path, payload)
    return payload


def paired_accept(online: Run, stale: Run, step: int, extra: Sequence[int] = ()
                  ) -> list[float]:
    """The stale run's drafter on the online run's policy: `stale`'s engine serves `online`'s
    current policy, rolls out `online`'s prompts of `step` with that step's seeds, then with
    the seeds of each step index in `extra` (evaluations: its drafter trains on none of
    them), then serves its own policy again, under the same version number (its run goes on
    as if nothing happened). Its accept length per seed set."""
    version = stale.engine.policy_version
    stale.engine.load_weights(online.actor.full_parameters(), version=version)
    try:
        return eval_accept(stale, step, [step, *extra], prompts_of=online)
    finally:
        stale.engine.load_weights(stale.actor.full_parameters(), version=version)


def eval_accept(run: Run, step: int, seeds_of: Sequence[int], prompts_of: Run | None = None
                ) -> list[float]:
    """`run`'s engine rolls out the prompts of `step` (of `prompts_of`, default `run`) once
    with the seeds of each step index in `seeds_of`, as evaluations its drafter never trains
    on; the accept length of each."""
    source = prompts_of or run
    items = source.prompts.batch(step, source.cfg.rollout.prompts_per_step)
    group = source.cfg.rollout.group_size
    out = []
    for index in seeds_of:
        completions = rollout(run, index, [it.ids for it in items], train_drafter=False)
        rewards = [source.prompts.score(items[i // group], source.decode(c.token_ids))
                   for i, c in enumerate(completions)]
        out.append(run.rollout_metrics(completions, rewards).get("rollout/accept_length", 1.0))
    return out


def _paired_summary(trained: list[float], online: list[list[float]], stale: list[list[float]]
                    ) -> dict[str, Any]:
    """Per step: the online drafter's accept length on the step's own seeds (`trained`, its
    training rollout) and on the extra seed sets (`online`), the stale drafter's on the same
    seeds (`stale`: the step's own first); the comparison is on the means over all."""
    online_all = [[t, *o] for t, o in zip(trained, online)]
    online_mean = [sum(o) / len(o) for o in online_all]
    stale_mean = [sum(s) / len(s) for s in stale]
    return {"seed_sets": len(stale[0]),
            "accept_length": [s[0] for s in stale], "online_accept_length": trained,
            "stale_per_seed": stale, "online_per_seed": online_all,
            "stale_mean": stale_mean, "online_mean": online_mean,
            "online_over_stale_first_seed": [o / s[0] for o, s in zip(trained, stale)],
            "online_over_stale": [o / s for o, s in zip(online_mean, stale_mean)],
            "online_above_every_step": all(o > s for o, s in zip(online_mean, stale_mean))}


def _arms(method: str, online: bool, backends: list[str] | None) -> dict[str, list[str]]:
    """Each arm's recipe overrides: speculation off / on, or one arm per rollout backend."""
    if not backends:   # off: plain decoding, so no drafter to train either
        return {"off": ["rollout.spec.method=none", "drafter.online.enabled=false",
                        "rollout.tuner.enabled=false", "rollout.budget.enabled=false"],
                "on": [f"rollout.spec.method={method}"]}
    unknown = sorted(set(backends) - set(ROLLOUT_BACKENDS))
    if unknown or len(backends) != 2 or len(set(backends)) != 2:
        raise FastdraftError(f"--backends: two of {', '.join(ROLLOUT_BACKENDS)} (e.g. "
                             f"native,vllm), got {','.join(backends)}")
    # vLLM has neither the tuner nor budgets: both arms serve the recipe's drafter without
    arms = {b: [f"rollout.backend={b}", "rollout.tuner.enabled=false",
                "rollout.budget.enabled=false"] for b in backends}
    if "vllm" in arms and online:
        arms["vllm_stale"] = [*arms["vllm"], "drafter.online.enabled=false"]
    return arms


def _summary(rows: dict[str, list[dict[str, float]]], ref: str, other: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, steps in rows.items():
        rewards = [r["reward/mean"] for r in steps]
        out[name] = dict(
            rollout_time_s=sum(r["rollout/time_s"] for r in steps),
            rollout_tokens=sum(r["rollout/tokens_per_s"] * r["rollout/time_s"] for r in steps),
            step_time_s=sum(r["timing/step_s"] for r in steps),
            rollout_share=sum(r["timing/rollout_s"] for r in steps)
            / sum(r["timing/step_s"] for r in steps),
            tail_share=sum(r["rollout/tail_time_s"] for r in steps)
            / max(sum(r["rollout/time_s"] for r in steps), 1e-9),
            rewards=rewards, reward_first5=sum(rewards[:5]) / len(rewards[:5]),
            reward_last5=sum(rewards[-5:]) / len(rewards[-5:]),
            reward_mean=sum(rewards) / len(rewards),
            accept_length=[r.get("rollout/accept_length", 1.0) for r in steps])
    off, on = out[ref], out[other]
    out["rollout_time_ratio"] = on["rollout_time_s"] / off["rollout_time_s"]
    # The runs train on their own samples, so their answers (the work) drift apart: tokens a
    # second of rollout compares the engines on the work each actually did.
    out["rollout_tokens_per_s_ratio"] = ((on["rollout_tokens"] / on["rollout_time_s"])
                                         / (off["rollout_tokens"] / off["rollout_time_s"]))
    out["step_time_ratio"] = on["step_time_s"] / off["step_time_s"]
    out["reward_mean_diff"] = on["reward_mean"] - off["reward_mean"]
    return out


def law_check(runs: dict[str, Run], num_prompts: int, num_seeds: int, ref: str = "off",
              other: str = "on") -> dict[str, Any]:
    """Two runs' engines roll out one policy (ref's, pushed into other's engine) with
    `num_seeds` seeds training never used; per seed, the mean reward and answer length."""
    if num_seeds < 2:
        return {"num_seeds": num_seeds}
    runs[other].engine.load_weights(runs[ref].actor.full_parameters())
    per_run: dict[str, dict[str, list[float]]] = {}
    for name in (ref, other):
        run = runs[name]
        items = run.prompts.batch(0, num_prompts)
        group = run.cfg.rollout.group_size
        rewards, lengths = [], []
        for i in range(num_seeds):
            # Steps past the last: seeds no training step drew from.
            completions = rollout(run, run.cfg.algorithm.num_steps + i, [it.ids for it in items],
                                  train_drafter=False)
            scores = [run.prompts.score(items[j // group], run.decode(c.token_ids))
                      for j, c in enumerate(completions)]
            rewards.append(sum(scores) / len(scores))
            lengths.append(sum(len(c.token_ids) for c in completions) / len(completions))
        per_run[name] = {"reward": rewards, "length": lengths}
    out: dict[str, Any] = {"num_seeds": num_seeds, **per_run}
    for key in ("reward", "length"):
        diff, half = _welch(per_run[other][key], per_run[ref][key])
        out[f"{key}_diff"], out[f"{key}_diff_95"] = diff, [diff - half, diff + half]
        out[f"{key}_consistent"] = diff - half <= 0 <= diff + half
    return out


def _welch(a: list[float], b: list[float]) -> tuple[float, float]:
    """mean(a) - mean(b) and the half-width of its 95% interval (normal quantile: the per-seed
    means average hundreds of samples)."""
    def var_of_mean(x: list[float]) -> float:
        m = sum(x) / len(x)
        return sum((v - m) ** 2 for v in x) / (len(x) - 1) / len(x)
    return (sum(a) / len(a) - sum(b) / len(b),
            1.96 * math.sqrt(var_of_mean(a) + var_of_mean(b)))


def _plot(rows: dict[str, list[dict[str, float]]], out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right, accept) = plt.subplots(1, 3, figsize=(15, 4))
    for name, steps in rows.items():
        x = list(range(1, len(steps) + 1))
        left.plot(x, [r["reward/mean"] for r in steps], marker="o", label=name)
        right.plot(x, [r["rollout/time_s"] for r in steps], marker="o", label=name)
        accept.plot(x, [r.get("rollout/accept_length", 1.0) for r in steps], marker="o",
                    label=name)
    left.set(title="reward per step (separate trajectories)", xlabel="step")
    right.set(title="rollout time per step (s)", xlabel="step")
    accept.set(title="accept length per step", xlabel="step")
    for ax in (left, right, accept):
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def summary_lines(out: dict[str, Any]) -> list[str]:
    ref, other = list(out["arms"])[:2]
    lines = [f"rollout_time_ratio ({other} / {ref}): {out['rollout_time_ratio']:.3f} (rollout "
             f"tokens/s {out['rollout_tokens_per_s_ratio']:.3f}); step_time_ratio "
             f"{out['step_time_ratio']:.3f}; rollout share " + ", ".join(
                 f"{name} {out[name]['rollout_share']:.0%}" for name in out["arms"]),
             "reward first 5 / last 5: " + ", ".join(
                 f"{name} {out[name]['reward_first5']:.3f} / {out[name]['reward_last5']:.3f}"
                 for name in out["arms"]) + f"; mean over the steps {other} - {ref} "
             f"{out['reward_mean_diff']:+.3f} (separate training trajectories: not paired)"]
    if len(out["arms"]) > 2 or ref != "off":
        lines += [f"accept length per step, {name}: " + " ".join(
            f"{a:.2f}" for a in out[name]["accept_length"]) for name in out["arms"]]
    if "paired_stale" in out:
        pair = out["paired_stale"]
        lines.append(f"accept length on the vllm run's policy, steps 2..N, mean of "
                     f"{pair['seed_sets']} seed sets: online " + " ".join(
                         f"{a:.2f}" for a in pair["online_mean"]) + "; stale " + " ".join(
                         f"{a:.2f}" for a in pair["stale_mean"]) + " (online above every "
                     f"step: {pair['online_above_every_step']})")
    law = out["law_check"]
    if "reward_diff" in law:
        lines.append(f"same policy, {law['num_seeds']} seeds each: reward {other} - {ref} "
                     f"{law['reward_diff']:+.4f} (95% {law['reward_diff_95'][0]:+.4f} .. "
                     f"{law['reward_diff_95'][1]:+.4f}), answer length {other} - {ref} "
                     f"{law['length_diff']:+.2f} (95% {law['length_diff_95'][0]:+.2f} .. "
                     f"{law['length_diff_95'][1]:+.2f})")
    return [*lines, f"plot: {out['plot']}"]

