from __future__ import annotations

from pathlib import Path

import pytest

from fastdraft.cli import main

TINY_RECIPE = str(Path(__file__).parents[1] / "recipes" / "tiny-grpo.yaml")


def test_bad_model_dir_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope")]) == 2
    assert "config.json not found" in capsys.readouterr().err


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for name in ("bootstrap", "generate", "bench", "drafter"):
        assert name in out


@pytest.mark.slow
def test_generate_demo_on_the_bootstrap_policy(capsys):
    assert main(["generate", "--num-prompts", "4", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert "4 completions" in out and "reward mean" in out


def test_bench_arguments_are_checked_before_any_work(capsys):
    from fastdraft.cli import main
    assert main(["bench", "spec", "--batch-sizes", "0"]) == 2
    assert "--batch-sizes must all be >= 1" in capsys.readouterr().err
    assert main(["bench", "spec", "--methods", "none,medusa"]) == 2
    assert "unknown ['medusa']" in capsys.readouterr().err


def test_drafter_warmup_names_its_own_flag(tmp_path, capsys):
    from fastdraft.cli import main
    assert main(["drafter", "warmup", "--policy", str(tmp_path)]) == 2
    assert "--policy takes an HF checkpoint directory" in capsys.readouterr().err


def test_a_misspelled_recipe_key_is_a_one_line_error(tmp_path, capsys):
    from fastdraft.cli import main
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout:\n  group_sise: 4\n")
    assert main(["run", str(recipe)]) == 2
    assert "did you mean 'rollout.group_size'" in capsys.readouterr().err


def test_overrides_may_follow_the_options_and_are_checked_there_too(tmp_path, capsys):
    from fastdraft.cli import main
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout:\n  group_size: 4\n")
    assert main(["run", str(recipe), "--run-dir", str(tmp_path / "run"), "actor.lrr=1"]) == 2
    assert "did you mean 'actor.lr'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", str(recipe), "--run-dir", str(tmp_path / "run"), "--no-such-flag"])
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_fastdraft_warnings_are_one_line_and_others_keep_their_form(monkeypatch):
    import warnings

    from fastdraft import cli
    from fastdraft.checkpoint import CheckpointWarning
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    cli._one_line_warnings()
    cli._one_line_warnings()   # main() may run many times in one process
    ours = warnings.formatwarning("skipping step-000004: delete it", CheckpointWarning,
                                  "run.py", 46, "latest = ...")
    assert ours == "fastdraft: warning: skipping step-000004: delete it\n"
    theirs = warnings.formatwarning("someone else's", UserWarning, "lib.py", 7, "warn()")
    assert "lib.py:7: UserWarning: someone else's" in theirs


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a torch without CUDA")
def test_a_cuda_recipe_on_a_torch_without_cuda_is_one_line_before_any_work(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["run", TINY_RECIPE, "model.device=cuda", "--run-dir",
                 str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "model.device=cuda, but this torch" in err and "CUDA build" in err
    assert "or set model.device=cpu" in err and len(err.strip().splitlines()) == 1
    assert not run_dir.exists()          # nothing written, nothing bootstrapped
    assert main(["run", TINY_RECIPE, "model.device=gpu"]) == 2
    assert "model.device must be cpu, cuda or cuda:N, got 'gpu'" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    from fastdraft import __version__
    assert capsys.readouterr().out.strip() == f"fastdraft {__version__}"
