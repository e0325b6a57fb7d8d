"""The bundled recipes parse; real-size ones (which cannot run here) name their missing paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastdraft.config import load_recipe
from fastdraft.rl.run import check_paths

RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("*.yaml"))


def test_every_bundled_recipe_parses():
    assert {p.name for p in RECIPES} >= {"tiny-grpo.yaml", "qwen2.5-7b-grpo.yaml",
                                          "qwen3-8b-grpo.yaml"}
    for path in RECIPES:
        cfg = load_recipe(path)
        assert cfg.name == path.stem


@pytest.mark.parametrize("name", ["qwen2.5-7b-grpo.yaml", "qwen3-8b-grpo.yaml"])
def test_real_recipes_are_checked_and_report_missing_paths(name):
    cfg = load_recipe(Path(__file__).parents[2] / "recipes" / name)
    assert cfg.model.dtype == "bfloat16" and cfg.actor.compute_dtype == "bfloat16"
    assert cfg.actor.num_ranks == 8
    assert cfg.data.path is not None and cfg.data.reward == "math"
    with pytest.raises(FileNotFoundError) as err:
        check_paths(cfg)
    for key in ("model.path", "data.path", "drafter.path"):
        assert key in str(err.value)


@pytest.mark.parametrize("key", ["actor.deepspeed={zero_optimization: {stage: 3}}",
                                 "actor.mixed_precision=bf16"])
def test_removed_actor_keys_say_what_replaced_them(key):
    with pytest.raises(ValueError, match=r"was removed: .*actor\.(num_ranks|compute_dtype)"):
        load_recipe(None, [key])
