"""Nothing of the user's is ever destroyed: every command's outputs replace only what fastdraft
wrote there (utils/outputs.py), never an input of the same command, unless --overwrite; a run
directory has one owner (run/run_dir.py: an OS lock naming its holder). Each case through the
CLI: exit 2, one line naming the setting and what to change, no traceback, the user's files
byte-for-byte intact, nothing trained or written."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastdraft.cli import main
from fastdraft.run.run_dir import LOCK_FILE, RunDirLock
from fastdraft.utils.outputs import MARKER, kind_of

TINY = str(Path(__file__).parents[1] / "recipes" / "tiny-grpo.yaml")
CLI = [sys.executable, "-m", "fastdraft.cli"]


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under `path` (or `path` itself) with its bytes."""
    if path.is_file():
        return {".": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


def refused(capsys, args: list[str], *expected: str, intact: tuple[Path, ...] = ()) -> str:
    """`fastdraft ARGS` exits 2 with one stderr line holding every `expected`; the files under
    `intact` are byte-for-byte as before."""
    before = {path: snapshot(path) for path in intact}
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and "Traceback" not in err[0], err
    for text in expected:
        assert text in err[0], err[0]
    for path in intact:
        assert snapshot(path) == before[path], path
    return err[0]


@pytest.fixture
def user_dir(tmp_path) -> Path:
    """A directory of the user's: not fastdraft's to replace."""
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("my notes")
    (mine / "sub" / "data.bin").write_bytes(os.urandom(64))
    return mine


@pytest.fixture
def user_file(tmp_path) -> Path:
    mine = tmp_path / "prompts.jsonl"
    mine.write_text('{"prompt": "1+2=", "answer": "3"}\n')
    return mine


def _warmup(policy: Path, out: Path, *extra: str) -> list[str]:
    return ["drafter", "warmup", "--policy", str(policy), "--out", str(out), "--steps", "10",
            "--num-rollouts", "2", *extra]


def test_warmup_never_replaces_a_users_directory_file_or_its_policy(
        char_policy, user_dir, user_file, tmp_path, capsys):
    refused(capsys, _warmup(char_policy, user_dir), f"--out {user_dir}: it holds 2 entries "
            "fastdraft did not write (notes.txt, sub)", "--overwrite", intact=(user_dir,))
    refused(capsys, _warmup(char_policy, user_file), f"--out {user_file}: a file is there",
            intact=(user_file,))
    refused(capsys, _warmup(char_policy, char_policy),
            f"--out {char_policy} is --policy {char_policy}, an input of this command",
            intact=(char_policy,))
    refused(capsys, _warmup(char_policy, char_policy.parent),
            f"--out {char_policy.parent} holds --policy {char_policy}", intact=(char_policy,))
    refused(capsys, _warmup(char_policy, tmp_path / "new", "--work-dir", str(user_dir)),
            f"--work-dir {user_dir}: it holds 2 entries", intact=(user_dir,))
    assert not (tmp_path / "new").exists() and not (tmp_path / "new.warmup").exists()


def test_warmup_replaces_its_own_drafter_and_with_overwrite_a_users_directory(
        char_policy, user_dir, tmp_path, capsys):
    out = tmp_path / "drafter"
    assert main(_warmup(char_policy, out)) == 0
    assert kind_of(out) == "drafter" and kind_of(tmp_path / "drafter.warmup") == "warmup"
    first = (out / "model.safetensors").stat().st_mtime_ns
    assert main(_warmup(char_policy, out, "--seed", "1")) == 0   # an earlier drafter: replaced
    assert (out / "model.safetensors").stat().st_mtime_ns != first
    capsys.readouterr()
    refused(capsys, _warmup(char_policy, tmp_path / "drafter.warmup"),
            "it holds a fastdraft warmup, not a drafter")
    assert main(_warmup(char_policy, user_dir, "--overwrite")) == 0   # the user said so
    assert not (user_dir / "notes.txt").exists() and kind_of(user_dir) == "drafter"
    capsys.readouterr()


def test_json_and_png_outputs_replace_only_fastdraft_files(user_file, tmp_path, capsys):
    refused(capsys, ["run", TINY, "--dry-run", "--json", str(user_file)],
            f"--json {user_file} is a file fastdraft did not write", "--overwrite",
            intact=(user_file,))
    refused(capsys, ["bench", "engine", "--json", str(user_file)],
            f"--json {user_file} is a file fastdraft did not write", intact=(user_file,))
    runs = tmp_path / "runs"
    (runs / "r").mkdir(parents=True)
    (runs / "r" / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward/mean": 0.5}) + "\n")
    png = tmp_path / "picture.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n not mine to replace")
    refused(capsys, ["plot", str(runs / "r"), "--out", str(png)],
            f"--out {png} is a file fastdraft did not write", intact=(png,))
    assert main(["plot", str(runs / "r"), "--out", str(tmp_path / "d.png")]) == 0
    assert main(["plot", str(runs / "r"), "--out", str(tmp_path / "d.png")]) == 0   # its own
    assert main(["plot", str(runs / "r"), "--out", str(png), "--overwrite"]) == 0
    capsys.readouterr()


def test_the_bench_json_is_refused_before_any_work(user_file, tmp_path, capsys):
    """An unwritable --json found after minutes of benching would lose them: checked first."""
    start = time.perf_counter()
    refused(capsys, ["bench", "spec", "--json", str(user_file), "--cache-dir",
                     str(tmp_path / "no-cache")], "--json", intact=(user_file,))
    assert not (tmp_path / "no-cache").exists()   # no bootstrap started
    assert time.perf_counter() - start < 30


def test_bench_run_dirs_of_someone_else_are_not_removed(user_dir, capsys):
    from fastdraft.bench.common import fresh_run_dirs
    from fastdraft.errors import FastdraftError
    out = user_dir.parent
    (out / "off").mkdir()
    (out / "off" / "mine.txt").write_text("mine")
    with pytest.raises(FastdraftError, match=r"--out-dir .*off: it holds 1 entry fastdraft"):
        fresh_run_dirs(out, ["on", "off"])
    assert (out / "off" / "mine.txt").read_text() == "mine" and not (out / "on").exists()
    dirs = fresh_run_dirs(out, ["on"])
    (dirs["on"] / "metrics.jsonl").write_text("")
    assert fresh_run_dirs(out, ["on"]) == dirs and not (dirs["on"] / "metrics.jsonl").exists()


def test_a_run_dir_of_someone_elses_files_is_refused_before_any_work(user_dir, tmp_path, capsys):
    refused(capsys, ["run", TINY, "--run-dir", str(user_dir), "--cache-dir", str(tmp_path / "c")],
            f"--run-dir {user_dir}: it holds 2 entries fastdraft did not write", "--overwrite",
            intact=(user_dir,))
    refused(capsys, ["run", TINY, "--dry-run", "--run-dir", str(user_dir)],
            f"--run-dir {user_dir}: it holds 2 entries", intact=(user_dir,))
    assert not (tmp_path / "c").exists()


def test_export_never_replaces_a_users_directory(user_dir, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "drafter").mkdir(parents=True)
    (run / "drafter" / "drafter_config.json").write_text("{}")
    refused(capsys, ["export", "--run", str(run), "--out", str(user_dir)],
            f"--out {user_dir}: it holds 2 entries", intact=(user_dir,))
    refused(capsys, ["export", "--run", str(run), "--out", str(run)],
            f"--out {run} is --run {run}, an input of this command")


def test_a_cache_dir_that_is_a_file_is_named(user_file, capsys):
    refused(capsys, ["run", TINY, "--dry-run", "--cache-dir", str(user_file)],
            f"--cache-dir {user_file} is a file: name a directory", intact=(user_file,))
    refused(capsys, ["bootstrap", "--cache-dir", str(user_file)], "is a file",
            intact=(user_file,))


def test_publish_replaces_only_what_fastdraft_wrote(tmp_path):
    from fastdraft.errors import FastdraftError
    from fastdraft.utils.atomic import atomic_dir
    final = tmp_path / "out"
    final.mkdir()
    (final / "mine.txt").write_text("mine")
    with pytest.raises(FastdraftError, match="fastdraft did not write it"), \
            atomic_dir(final, kind="drafter") as tmp:
        (tmp / "new").write_text("new")
    assert (final / "mine.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]   # no temp dir left
    shutil.rmtree(final)
    for text in ("one", "two"):   # its own output of the same kind: replaced
        with atomic_dir(final, kind="drafter") as tmp:
            (tmp / "new").write_text(text)
    assert (final / "new").read_text() == "two" and kind_of(final) == "drafter"
    with pytest.raises(FastdraftError, match="did not write it as a export"), \
            atomic_dir(final, kind="export") as tmp:
        pass


# ---- one owner per run directory -------------------------------------------------------------


def test_a_locked_run_dir_is_refused_to_every_writer_naming_its_holder(tmp_path, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "drafter").mkdir(parents=True)
    (run_dir / "drafter" / "drafter_config.json").write_text("{}")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward/mean": 0.5}) + "\n")
    (run_dir / "memory_plan.json").write_text("{}")   # a run of an older fastdraft: no marker
    with RunDirLock.claim(run_dir):
        holder = f"is in use by pid {os.getpid()} on "
        before = snapshot(run_dir)
        for args in (["run", TINY, "--run-dir", str(run_dir)],
                     ["run", TINY, "--run-dir", str(run_dir), "--resume"],
                     ["run", TINY, "--run-dir", str(run_dir), "--dry-run"],
                     ["plot", str(run_dir)],
                     ["export", "--run", str(run_dir)]):
            refused(capsys, args, holder, "wait for it to end")
        assert snapshot(run_dir) == before
        # Elsewhere, a live run's metrics may be drawn.
        assert main(["plot", str(run_dir), "--out", str(tmp_path / "elsewhere.png")]) == 0
    assert json.loads((run_dir / LOCK_FILE).read_text() or "null") is None   # released: clear
    assert main(["plot", str(run_dir)]) == 0
    capsys.readouterr()


def test_a_stale_lock_of_a_killed_process_is_taken_over_with_a_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    killed = subprocess.run([sys.executable, "-c", (
        "import os, signal, sys; from pathlib import Path; "
        "from fastdraft.run.run_dir import RunDirLock; "
        f"RunDirLock.claim(Path({str(run_dir)!r})); os.kill(os.getpid(), signal.SIGKILL)")])
    assert killed.returncode == -signal.SIGKILL
    dead = json.loads((run_dir / LOCK_FILE).read_text())
    with RunDirLock.claim(run_dir):
        err = capsys.readouterr().err
        assert f"its lock named pid {dead['pid']} on " in err and "taken over" in err
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_a_refused_start_leaves_no_run_dir_behind(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError), RunDirLock.claim(run_dir):
        assert (run_dir / MARKER).is_file()
        raise RuntimeError("the start failed")
    assert not run_dir.exists()


@pytest.mark.slow
def test_two_runs_in_one_run_dir_the_second_refused_the_first_whole(policy_and_drafter,
                                                                     tmp_path):
    """Real processes: the second `fastdraft run` of a directory in use is one line naming the
    first, which goes on undisturbed (stopped here by SIGTERM once the second is refused): its
    metrics every step it took, its config and checkpoint its own."""
    policy, _ = policy_and_drafter
    run_dir = tmp_path / "run"
    overrides = [f"model.path={policy}", "rollout.spec.method=none",
                 "drafter.online.enabled=false", "data.task_options.max_terms=5",
                 "rollout.prompts_per_step=4", "rollout.group_size=4",
                 "rollout.max_new_tokens=32", "checkpoint.every=1000",
                 "logging.wandb.mode=disabled", "logging.dashboard=false", "logging.progress=false"]
    first = subprocess.Popen([*CLI, "run", TINY, *overrides, "algorithm.num_steps=1000",
                              "--run-dir", str(run_dir)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "metrics.jsonl").read_text():
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.1)
    second = subprocess.run([*CLI, "run", TINY, *overrides, "algorithm.num_steps=3",
                             "--run-dir", str(run_dir)], capture_output=True, text=True,
                            timeout=300)
    err = [x for x in second.stderr.splitlines() if not x.startswith("[fastdraft")]
    assert second.returncode == 2 and len(err) == 1, second.stderr
    assert f"is in use by pid {first.pid} on " in err[0]
    assert first.poll() is None, "the first run ended before the second was refused"
    first.send_signal(signal.SIGTERM)
    _, first_err = first.communicate(timeout=300)
    assert first.returncode == 143, first_err
    step = int(first_err.split("stopped at step ")[1].split(";")[0])
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert step >= 2 and [r["step"] for r in rows] == list(range(step))
    [ckpt] = (run_dir / "checkpoints").glob("step-*")
    assert json.loads((ckpt / "run_config.json").read_text())["algorithm"]["num_steps"] == 1000
    assert "num_steps: 1000" in (run_dir / "config.yaml").read_text()
