from __future__ import annotations

import pytest

from fastdraft.cli import main


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
