"""Recipes map 1:1 onto the RunConfig sections; mistakes are errors that say what to change."""

from __future__ import annotations

import pytest

from fastdraft.config import RunConfig, dump_config, load_recipe


def _write(tmp_path, text: str):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


def test_a_recipe_and_dotted_overrides_build_checked_sections(tmp_path):
    path = _write(tmp_path, "name: t\nactor:\n  lr: 3.0e-6\nrollout:\n  spec:\n    depth: 4\n")
    cfg = load_recipe(path, ["actor.lr=1e-5", "rollout.spec.method=none", "seed=7"])
    assert isinstance(cfg, RunConfig) and cfg.name == "t" and cfg.seed == 7
    assert cfg.actor.lr == 1e-5 and isinstance(cfg.actor.lr, float)  # YAML reads 1e-5 as text
    # a partial section keeps the defaults of the keys it leaves out
    assert cfg.rollout.spec.method == "none" and cfg.rollout.spec.depth == 4
    assert cfg.rollout.spec.topk == RunConfig().rollout.spec.topk


@pytest.mark.parametrize("text, override, message", [
    ("actor:\n  lrr: 1\n", None, "did you mean 'actor.lr'"),
    ("rollot:\n  group_size: 2\n", None, "did you mean 'rollout'"),
    ("name: t\n", "rollout.spec.methd=eagle", "did you mean 'rollout.spec.method'"),
    ("name: t\n", "actor.lr=fast", "actor.lr must be a number"),
    ("name: t\n", "rollout.group_size=2.5", "must be an integer"),
    ("name: t\n", "logging.progress=maybe", "must be true or false"),
    ("name: t\n", "rollout.spec.method=medusa", "unknown spec method"),
    ("name: t\n", "model.dtype=float8", "model.dtype must be one of"),
    ("name: t\n", "data.path=x.jsonl", "set exactly one of data.task"),
    ("- a\n- b\n", None, "must be a mapping"),
    ("actor: [1, 2\n", None, "not valid YAML"),
    ("name: t\n", "actor.lr", "is not KEY=VALUE"),
    ("drafter:\n  online:\n    max_sample_tokens: 128\n", "drafter.online.window_context=65",
     r"window_context must be in \[0, 64\]"),
    ("name: t\n", "drafter.online.lr_warmup_steps=-1", "lr_warmup_steps must be >= 0"),
    ("name: t\n", "drafter.online.holdout_every=1",
     r"holdout_every must be 0 or >= 2 \(0: no check"),
    # the local backend rolls out on one device: 8 GPUs of actor ranks take the hybrid layout
    ("model:\n  device: cuda\nactor:\n  num_ranks: 8\n", None,
     "set cluster.backend=ray cluster.placement=hybrid cluster.rollout_workers=8"),
])
def test_mistakes_name_what_to_change(tmp_path, text, override, message):
    with pytest.raises(ValueError, match=message):
        load_recipe(_write(tmp_path, text), [override] if override else [])


def test_windows_lead_with_half_a_window_of_context_at_most_128_by_default(tmp_path):
    path = _write(tmp_path, "name: t\n")
    assert load_recipe(path, []).drafter.online.context_tokens == 128   # token_budget 2048
    small = load_recipe(path, ["drafter.online.token_budget=64"]).drafter.online
    assert small.context_tokens == 32
    assert load_recipe(path, ["drafter.online.window_context=0"]).drafter.online.context_tokens == 0


def test_a_missing_recipe_file_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="recipes/"):
        load_recipe(tmp_path / "nope.yaml")


def test_the_resolved_config_round_trips(tmp_path):
    cfg = load_recipe(None, ["actor.betas=[0.8, 0.95]", "algorithm.loss=dapo"])
    dump_config(cfg, tmp_path / "config.yaml")
    assert load_recipe(tmp_path / "config.yaml") == cfg


def test_the_tuner_section_checks_its_arms_when_the_recipe_loads():
    from fastdraft.config.sections import TunerSection
    cfg = load_recipe(None, ["rollout.tuner.enabled=true"])
    tuner = cfg.rollout.tuner.build(cfg.rollout.spec, seed=0)
    elastic = [b for b in tuner.buckets if b.min_batch >= cfg.rollout.tuner.elastic_threshold]
    assert elastic and all(not b.arms[0].enabled for b in elastic)   # "off" leads there
    with pytest.raises(ValueError, match=r"rollout\.tuner: arm 'eagle/6/x'"):
        TunerSection(enabled=True, buckets={1: ["eagle/6/x"]})
    with pytest.raises(ValueError, match="needs a speculative"):
        load_recipe(None, ["rollout.tuner.enabled=true", "rollout.spec.method=none"])
