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


def _failing_command(monkeypatch, error: BaseException, name: str = "plot") -> None:
    """`fastdraft NAME` made to raise `error` (the handler is the same for every command)."""
    import fastdraft.cli as cli
    add_args, _, help_text = cli.COMMANDS[name]

    def fail(args):
        raise error
    monkeypatch.setitem(cli.COMMANDS, name, (add_args, fail, help_text))


def test_a_bug_is_one_line_and_its_traceback_goes_to_the_crash_log(monkeypatch, tmp_path,
                                                                   capsys):
    _failing_command(monkeypatch, KeyError("no-such-key"), "generate")
    assert main(["generate", "--cache-dir", str(tmp_path / "cache")]) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "unexpected error" in line and "KeyError" in line and "Traceback" not in line
    log = tmp_path / "cache" / "crash.log"
    assert f"the traceback is in {log}" in line
    assert "Traceback" in log.read_text() and "raise error" in log.read_text()


def test_an_os_error_under_a_chosen_dir_names_the_path_and_the_setting(monkeypatch, tmp_path,
                                                                       capsys):
    import errno
    import os
    bad = tmp_path / "out" / "x.png"
    try:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(bad))
    except OSError as cause:
        wrapped = RuntimeError("background write failed")
        wrapped.__cause__ = cause
    _failing_command(monkeypatch, wrapped)
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == (f"fastdraft plot: error: No space left on device: {bad} (under --out "
                    f"{tmp_path / 'out'}): free space there or choose a directory on another "
                    "disk")


@pytest.mark.parametrize("error, code", [(KeyboardInterrupt(), 130)])
def test_a_stop_outside_a_run_is_one_line(monkeypatch, tmp_path, capsys, error, code):
    _failing_command(monkeypatch, error)
    assert main(["plot", str(tmp_path)]) == code
    assert capsys.readouterr().err.strip() == "fastdraft plot: stopped by SIGINT"


def test_sigterm_outside_a_run_is_one_line_too(monkeypatch, tmp_path, capsys):
    import signal

    import fastdraft.cli as cli
    add_args, _, help_text = cli.COMMANDS["plot"]

    def terminated(args):
        signal.raise_signal(signal.SIGTERM)   # main() turned SIGTERM into Interrupted
    monkeypatch.setitem(cli.COMMANDS, "plot", (add_args, terminated, help_text))
    old = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["plot", str(tmp_path)]) == 143
    finally:
        signal.signal(signal.SIGTERM, old)
    assert capsys.readouterr().err.strip() == "fastdraft plot: stopped by SIGTERM"


def test_every_flag_of_every_command_has_help_text():
    import argparse

    from fastdraft.cli import COMMANDS
    for name, (add_args, _, _) in COMMANDS.items():
        parser = argparse.ArgumentParser()
        add_args(parser)
        bare = [a.option_strings or a.dest for a in parser._actions if not a.help]
        assert not bare, (name, bare)
