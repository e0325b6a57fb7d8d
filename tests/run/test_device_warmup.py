"""`fastdraft drafter warmup` on the devices: one or two data-parallel members serve the
rollouts with the engine and capture their hidden states (the same rollouts either way), train
on them and reach the same held-out accept length; on GPUs each member gets a GPU of its own; a
warm-up killed mid-training resumes from its last saved state without capturing again; the
progress bar shows tokens/s and the ETA."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from fastdraft.databuffer.spill import load_spill
from fastdraft.drafter import build_drafter, load_drafter
from fastdraft.drafter.acceptance import expected_accept
from fastdraft.drafter.warmup import WarmupConfig
from fastdraft.engine import RolloutEngine, SamplingParams
from fastdraft.models import load_model
from fastdraft.run.device_warmup import DevicePlan, device_warmup
from fastdraft.trainer.warmup_train import STATE_FILE

pytestmark = pytest.mark.xdist_group("ray")
CFG = WarmupConfig(kind="eagle3", num_rollouts=48, max_new_tokens=24, steps=30, warmup_steps=3,
                   lr=3e-3)


def _prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 40, (6,), generator=gen).tolist() for _ in range(n)]


def _held_out_accept(policy_dir, drafter_dir) -> float:
    """Expected accept length (depth 3) on held-out rollouts of the policy."""
    policy = load_model(policy_dir, max_positions=64)
    drafter = (build_drafter("eagle3", policy.config, 64).attach(policy) if drafter_dir is None
               else load_drafter(drafter_dir, policy, 64))
    engine = RolloutEngine.from_model(policy, max_batch_size=16, max_seq_len=40)
    outs = engine.generate(_prompts(16, seed=99), SamplingParams(seed=7, max_new_tokens=24))
    total = None
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids + out.token_ids])
        with torch.no_grad():
            _, hidden = policy(ids, torch.arange(ids.shape[1]).view(1, -1),
                               aux_layers=drafter.aux_layers)
            valid = torch.zeros_like(ids, dtype=torch.bool)
            valid[:, len(out.prompt_token_ids) - 2:] = True
            got = expected_accept(drafter, ids, hidden, valid, policy.lm_head, 3)
        total = got if total is None else total + got
    return total.mean


def test_one_and_two_members_warm_up_drafters_that_accept_alike(char_policy, tmp_path):
    accepts = {}
    for workers in (1, 2):
        out = tmp_path / f"drafter-{workers}"
        report = device_warmup(char_policy, out, _prompts(CFG.num_rollouts, seed=1), CFG,
                               DevicePlan(workers=workers, token_budget=512, save_every=10),
                               tmp_path / f"work-{workers}", progress=False)
        assert report.train_tokens > 0 and report.num_rollouts == CFG.num_rollouts
        meta = json.loads((out / "drafter_config.json").read_text())
        assert meta["warmup_workers"] == workers and meta["warmup_device"] == "cpu"
        accepts[workers] = _held_out_accept(char_policy, out)
    # the members shared the rollouts: two served the same ones as one, each its own chunks
    captured = {w: [sorted(tuple(s.token_ids.tolist()) for s in load_spill(
        tmp_path / f"work-{w}" / f"capture-{r}")) for r in range(w)] for w in (1, 2)}
    assert all(captured[2]) and sorted(captured[2][0] + captured[2][1]) == captured[1][0]
    untrained = _held_out_accept(char_policy, None)
    print(f"held-out expected accept length: 1 member {accepts[1]:.3f}, 2 members "
          f"{accepts[2]:.3f}, untrained {untrained:.3f}")
    assert min(accepts.values()) > untrained + 0.3
    assert abs(accepts[1] - accepts[2]) < 0.1 * accepts[1]


def test_a_killed_warmup_resumes_where_it_saved(char_policy, tmp_path):
    out, work = tmp_path / "drafter", tmp_path / "work"
    command = [sys.executable, "-m", "fastdraft.cli", "drafter", "warmup", "--policy",
               str(char_policy), "--kind", "eagle3", "--num-rollouts", "32", "--steps", "400",
               "--token-budget", "256", "--save-every", "5", "--out", str(out), "--work-dir",
               str(work)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env,
                            text=True)
    state = work / STATE_FILE
    deadline = time.monotonic() + 240
    while not state.is_file() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)
    stderr = proc.communicate()[1]
    assert state.is_file() and not out.exists()
    # the bar: steps of all, the ETA, trained tokens/s
    assert "drafter warm-up" in stderr and "tok_s=" in stderr and "<" in stderr
    killed = torch.load(state, weights_only=False)
    saved = killed["steps"]
    shards = {p: p.stat().st_mtime_ns for p in (work / "capture-0").glob("shard-*")}
    assert 0 < saved < 400 and shards

    from fastdraft.demo import prompt_ids
    prompts = prompt_ids(char_policy, None, 32, heldout=False)

    def resume(steps: int):
        cfg = WarmupConfig(kind="eagle3", num_rollouts=32, steps=steps, warmup_steps=0)
        return device_warmup(char_policy, out, prompts, cfg,
                             DevicePlan(token_budget=256, save_every=5), work, resume=True,
                             progress=False)

    # resumed to where it saved: no step taken, the drafter is the saved one, bit for bit
    resume(saved)
    kept = killed["drafter"]
    policy = load_model(char_policy)
    for name, tensor in load_drafter(out, policy, 64).named_parameters():
        assert torch.equal(tensor, kept[name]), name
    # and on from there, the captured rollouts read, not made again
    report = resume(saved + 10)
    assert torch.load(state, weights_only=False)["steps"] == saved + 10
    assert {p: p.stat().st_mtime_ns for p in (work / "capture-0").glob("shard-*")} == shards
    assert report.train_tokens > 0


def test_a_member_that_does_not_fit_its_device_is_refused_before_training(char_policy,
                                                                          tmp_path):
    from fastdraft.errors import FastdraftError
    with pytest.raises(FastdraftError, match=r"a warm-up member needs .* lower --token-budget"):
        device_warmup(char_policy, tmp_path / "drafter", _prompts(8, seed=1), CFG,
                      DevicePlan(token_budget=100_000_000), tmp_path / "work", progress=False)
    assert not (tmp_path / "drafter").exists()


def test_the_warmup_takes_the_recipes_prompts_as_its_run_tokenizes_them(char_policy, tmp_path,
                                                                         capsys):
    from fastdraft.cli import main
    from fastdraft.config import load_recipe
    from fastdraft.run.inputs import recipe_prompts
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nmodel:\n  path: {char_policy}\ndata:\n  task: modsum\n"
                      "  seed: 3\nrollout:\n  max_new_tokens: 16\n")
    prompts = recipe_prompts(load_recipe(recipe), char_policy, 8)
    from fastdraft.data.prompts import PromptSource
    from fastdraft.run.inputs import load_tokenizer
    cfg = load_recipe(recipe)
    want = PromptSource(cfg.data, load_tokenizer(char_policy, "model.path"), 10**6).batch(0, 8)
    assert prompts == [it.ids for it in want] and len(set(map(tuple, prompts))) > 1
    out = tmp_path / "drafter"
    assert main(["drafter", "warmup", "--recipe", str(recipe), "--kind", "eagle3",
                 "--num-rollouts", "8", "--steps", "60", "--out", str(out)]) == 0
    assert "8 rollouts" in capsys.readouterr().out and (out / "drafter_config.json").is_file()
    assert main(["drafter", "warmup", "--recipe", str(recipe), "--prompts", str(recipe),
                 "--out", str(out)]) == 2
    assert "--prompts and --recipe both name the prompts" in capsys.readouterr().err
