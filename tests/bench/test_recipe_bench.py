"""`bench recipe` runs a recipe with speculation off and on, interleaved, and compares them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fastdraft.bench.recipe_bench import (
    _arms,
    _paired_summary,
    paired_accept,
    run_recipe_bench,
    summary_lines,
)
from fastdraft.config import load_recipe
from fastdraft.run.loop import train_step
from fastdraft.run.run import Run


def test_recipe_bench_reports_ratios_curves_and_a_plot(char_policy, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nmodel:\n  path: {char_policy}\nrollout:\n  prompts_per_step: 2\n"
                      "  group_size: 4\n  max_new_tokens: 8\n  max_batch_size: 8\n  spec:\n"
                      "    method: suffix\nalgorithm:\n  num_steps: 2\n")
    out = run_recipe_bench(recipe, ["actor.lr=1e-3", "rollout.tuner.enabled=true",
                                    "rollout.budget.enabled=true"],
                           tmp_path / "runs", tmp_path / "b.json",
                           law_seeds=3)
    assert out["rollout_time_ratio"] > 0 and out["step_time_ratio"] > 0
    for name in ("off", "on"):
        assert len(out[name]["rewards"]) == 2 and 0 < out[name]["rollout_share"] < 1
    assert out["on"]["accept_length"][0] >= 1.0 and out["off"]["accept_length"] == [1.0, 1.0]
    law = out["law_check"]
    assert law["num_seeds"] == 3 and len(law["on"]["reward"]) == len(law["off"]["length"]) == 3
    for key in ("reward", "length"):
        low, high = law[f"{key}_diff_95"]
        assert low <= law[f"{key}_diff"] <= high
    assert json.loads((tmp_path / "b.json").read_text())["num_steps"] == 2
    assert (tmp_path / "runs" / "recipe_bench.png").stat().st_size > 5000
    assert all(isinstance(line, str) and line for line in summary_lines(out))


def test_backend_arms_are_each_backend_speculating_and_vllm_with_a_stale_drafter():
    arms = _arms("eagle", True, ["native", "vllm"])
    assert list(arms) == ["native", "vllm", "vllm_stale"]   # native first: the reference
    assert "rollout.backend=vllm" in arms["vllm"] and "rollout.backend=native" in arms["native"]
    assert arms["vllm_stale"] == [*arms["vllm"], "drafter.online.enabled=false"]
    assert list(_arms("eagle", False, ["native", "vllm"])) == ["native", "vllm"]   # no online
    assert list(_arms("eagle", True, None)) == ["off", "on"]
    for bad in (["native", "sglang"], ["vllm"], ["vllm", "vllm"]):
        with pytest.raises(ValueError, match="--backends: two of native, vllm"):
            _arms("eagle", True, bad)


def test_a_sharded_actor_is_refused_with_the_override_to_add(tmp_path):
    recipe = Path(__file__).parents[2] / "recipes" / "tiny-qwen3-eagle3.yaml"
    with pytest.raises(ValueError, match=r"add actor\.num_ranks=1"):
        run_recipe_bench(recipe, [], tmp_path)


def test_paired_accept_rolls_out_on_the_online_policy_and_gives_the_stale_run_its_own_back(
        char_policy, tmp_path):
    """bench recipe --backends native,vllm's paired evaluation, on two native runs: the stale
    run's engine serves the online run's policy for one evaluation rollout, then its own again
    under the same version (its own run is untouched)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nmodel:\n  path: {char_policy}\nrollout:\n  prompts_per_step: 2\n"
                      "  group_size: 4\n  max_new_tokens: 8\n  max_batch_size: 8\n  spec:\n"
                      "    method: suffix\nalgorithm:\n  num_steps: 2\nlogging:\n  wandb:\n"
                      "    mode: disabled\n")
    online = Run(load_recipe(recipe, []), tmp_path / "online")
    stale = Run(load_recipe(recipe, []), tmp_path / "stale")
    try:
        train_step(online, 0)
        train_step(stale, 0)

        def params(named) -> dict[str, torch.Tensor]:
            return {k: v.detach().clone().float() for k, v in named}
        # The online run's policy moved (tiny rewards teach little in one step: moved by hand).
        moved = {k: v + 0.01 * torch.randn_like(v)
                 for k, v in params(online.actor.full_parameters()).items()}
        online.actor.full_parameters = lambda: iter(moved.items())
        theirs, own = moved, params(stale.actor.full_parameters())
        assert any(not torch.equal(theirs[k], own[k]) for k in own)   # the policies differ
        served, real_generate = [], stale.engine.generate

        def generate(*args, **kwargs):
            served.append(params(stale.engine.model.named_parameters()))
            return real_generate(*args, **kwargs)
        stale.engine.generate = generate
        version = stale.engine.policy_version
        accept = paired_accept(online, stale, 1, extra=[7, 8])
        assert len(accept) == 3 and min(accept) >= 1.0 and len(served) == 3
        shared = [k for k in served[0] if k in theirs]
        assert shared and all(torch.equal(s[k], theirs[k]) for s in served for k in shared)
        after = params(stale.engine.model.named_parameters())
        assert all(torch.equal(after[k], own[k]) for k in shared)   # its own policy back
        assert stale.engine.policy_version == version
        del stale.engine.generate
        assert train_step(stale, 1)["rollout/logprob_diff_max"] < 1e-4   # its gate holds
    finally:
        online.finish()
        stale.finish()


def test_the_paired_comparison_is_over_every_seed_set_of_a_step():
    """A step where the training rollout's seeds favour the stale drafter but the other seed
    sets favour the online one counts as above (the means decide), and one step below on
    the means makes online_above_every_step false."""
    out = _paired_summary(trained=[5.0, 6.0], online=[[6.0, 6.2], [5.0, 5.0]],
                          stale=[[5.5, 5.6, 5.7], [5.4, 5.6, 5.5]])
    assert out["seed_sets"] == 3
    assert out["online_per_seed"] == [[5.0, 6.0, 6.2], [6.0, 5.0, 5.0]]
    assert out["online_over_stale_first_seed"][0] < 1 < out["online_over_stale"][0]
    assert out["online_mean"][1] < out["stale_mean"][1]
    assert not out["online_above_every_step"]
    assert _paired_summary([6.0], [[6.0]], [[5.0, 5.0]])["online_above_every_step"]
