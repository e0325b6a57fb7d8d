"""A dry run that passes means the run starts: every refusal the run makes before its first step,
walked one check at a time, is made by `fastdraft run --dry-run` too, with the same one line
(exit 2, no traceback, nothing written under the run dir or the cache, no process left).

CHECKS is the list, in the order the run makes them (run_recipe's claim of the run directory,
its resume point, then run/preflight.py); the README's "What the dry run checks" lists the same
names (a test below holds them equal). Each check has at least one case here."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from fastdraft.cli import main
from tests.test_bad_input import FILE_PROMPTS, TINY

CHECKS = {
    "recipe": "the recipe's keys, value types and ranges, no key twice",
    "run directory": "its owner (a live run's lock), fastdraft's own files, the checkpoint a "
                     "resume starts from and whether the recipe may change on resume",
    "paths": "every local path the recipe names exists",
    "policy": "a supported architecture, its tokenizer files, weight files whole and holding "
              "every weight of its shape in a float dtype, as many positions as the sequences",
    "drafter source": "an EAGLE recipe names its drafter (or warms one up for the bootstrap "
                      "policy)",
    "devices": "actor.num_ranks against this node's devices, and the CUDA devices the recipe "
               "names (a dry run on a machine without GPUs plans a node of them and says so)",
    "backend": "vLLM installed for rollout.backend=vllm",
    "cluster address": "cluster.address answering within cluster.connect_timeout_s",
    "prompt file": "UTF-8, rows there, unique columns, every prompt and answer non-empty text",
    "run dir writable": "a file in the way or a read-only disk, then free space for a "
                        "checkpoint",
    "tokenizer": "the policy's tokenizer turns text into tokens",
    "prompt lengths": "every prompt of the file (by row) one token or more and within "
                      "rollout.max_seq_len - rollout.max_new_tokens",
    "drafter fits": "the drafter trained for this policy, its weights' names, shapes and "
                    "dtypes, the online trainer's loss for its kind",
    "memory plan": "the paged KV cache holds one longest sequence; the engine, actor and "
                   "trainer member fit the device",
}

Case = Callable[[Path, Path, Path], list[str]]


def _fast(policy: Path) -> list[str]:
    return [f"model.path={policy}", "rollout.spec.method=none", "drafter.online.enabled=false",
            "data.task_options.max_terms=5", "rollout.max_new_tokens=32",
            "logging.wandb.mode=disabled"]


def _copy(src: Path, dst: Path, edit: Callable[[dict], None] | None = None) -> Path:
    shutil.copytree(src, dst)
    if edit is not None:
        tensors = load_file(dst / "model.safetensors")
        edit(tensors)
        save_file(tensors, str(dst / "model.safetensors"), {"format": "pt"})
    return dst


WEIGHT = "model.layers.0.mlp.down_proj.weight"


def _file(tmp: Path, name: str, data: bytes) -> Path:
    (tmp / name).write_bytes(data)
    return tmp / name


def _prompts(tmp: Path, name: str, data: bytes) -> list[str]:
    return [*FILE_PROMPTS, f"data.path={_file(tmp, name, data)}"]


def _eagle(drafter: Path) -> list[str]:
    return ["rollout.spec.method=eagle", f"drafter.path={drafter}"]


def _other_policy_drafter(tmp: Path) -> Path:
    from fastdraft.drafter import build_drafter, save_drafter
    from fastdraft.models import load_model
    from tests.conftest import make_tiny_checkpoint
    other = tmp / "other-policy"
    make_tiny_checkpoint(other, hidden_size=32, intermediate_size=64)
    torch.manual_seed(0)
    save_drafter(build_drafter("eagle1", load_model(other).config, 64).attach(load_model(other)),
                 tmp / "other-drafter")
    return tmp / "other-drafter"


def _not_json_drafter(tmp: Path, drafter: Path) -> Path:
    out = shutil.copytree(drafter, tmp / "not-json-drafter")
    (out / "drafter_config.json").write_text("{not json")
    return out


def _specforge(tmp: Path, policy: Path, config: dict | None = None,
               int_fc: bool = False) -> Path:
    """A SpecForge EAGLE-3 directory for the policy (tests/export's writer), edited."""
    from tests.export.conftest import specforge_checkpoint
    vocab = json.loads((policy / "config.json").read_text())["vocab_size"]
    out = specforge_checkpoint(tmp / "specforge", vocab=vocab, draft_vocab=vocab,
                               sglang_aux_ids=[0, 0, 1], max_positions=512, config=config)
    if int_fc:
        tensors = load_file(out / "model.safetensors")
        tensors["fc.weight"] = tensors["fc.weight"].to(torch.int32)
        save_file(tensors, str(out / "model.safetensors"))
    return out


def _int_drafter(tmp: Path, drafter: Path) -> Path:
    out = shutil.copytree(drafter, tmp / "int-drafter")
    tensors = load_file(out / "model.safetensors")
    tensors["fc.weight"] = tensors["fc.weight"].to(torch.int32)
    save_file(tensors, str(out / "model.safetensors"), {"format": "pt"})
    (out / "SHA256SUMS").unlink()
    return out


CASES: list[tuple[str, Case, tuple[str, ...]]] = [
    ("recipe", lambda t, p, d: ["actor.grad_clip=-1"], ("actor.grad_clip must be > 0",)),
    ("recipe", lambda t, p, d: ["rollout.top_k=0"], ("rollout.top_k must be -1 or >= 1",)),
    ("recipe", lambda t, p, d: ["rollout.group_size=1"], ("rollout.group_size",)),
    ("recipe", lambda t, p, d: ["data.task_pool=-3"], ("data.task_pool",)),
    ("recipe", lambda t, p, d: ["actor.lr=.inf"], ("actor.lr",)),
    ("recipe", lambda t, p, d: ["drafter.online.offset_mix=7"], ("drafter.online.offset_mix",)),
    ("recipe", lambda t, p, d: ["rollout.max_seq_len=10"], ("rollout.max_seq_len",
                                                             "rollout.max_new_tokens")),
    ("paths", lambda t, p, d: [f"data.path={t / 'nowhere.jsonl'}", *FILE_PROMPTS[:3],
                               "rollout.max_seq_len=300"],
     ("the recipe names paths that do not exist",)),
    ("policy", lambda t, p, d: [f"model.path={_copy(p, t / 'p', lambda w: w.pop(WEIGHT))}"],
     ("lacks 1 of the", WEIGHT)),
    ("policy", lambda t, p, d: [f"model.path={_copy(p, t / 'p', lambda w: w.update({WEIGHT: w[WEIGHT][:, :-1].contiguous()}))}"],  # noqa: E501
     (f"{WEIGHT} has shape", "its config.json says")),
    ("policy", lambda t, p, d: [f"model.path={_copy(p, t / 'p', lambda w: w.update({WEIGHT: w[WEIGHT].to(torch.int8)}))}"],  # noqa: E501
     (f"{WEIGHT} is I8, not a float type",)),
    ("policy", lambda t, p, d: ["data.task_options.max_terms=120", "rollout.max_new_tokens=400"],
     ("past model.path's max_position_embeddings 512",)),
    ("drafter source", lambda t, p, d: ["rollout.spec.method=eagle"],
     ("needs drafter.path for a policy of your own",)),
    ("devices", lambda t, p, d: ["actor.num_ranks=64", "actor.micro_batch_tokens=512"],
     ("actor.num_ranks=64, but this machine has",)),
    ("prompt file", lambda t, p, d: _prompts(t, "l.jsonl", '{"prompt": "caf\xe9 1+2=", '
                                                            '"answer": "3"}\n'.encode("latin-1")),
     ("is not UTF-8 text: line 1 has the byte 0xe9",)),
    ("prompt file", lambda t, p, d: _prompts(t, "b.jsonl", b"\n\n"), ("holds only blank lines",)),
    ("prompt file", lambda t, p, d: _prompts(t, "n.jsonl", b'{"prompt": "1+2=", "answer": "3"}\n'
                                                           b'{"prompt": "2+2=", "answer": 4}\n'),
     ("row 1 (line 2): its answer (column 'answer') is 4, not text",)),
    ("prompt file", lambda t, p, d: [*FILE_PROMPTS, f"data.path={_dup_columns(t)}"],
     ("has the column(s) ['prompt'] more than once",)),
    ("prompt file", lambda t, p, d: [*_prompts(t, "k.jsonl", b'{"q": "1+2=", "a": "3"}\n'),
                                     "data.prompt_key=q", "data.answer_key=q"],
     ("data.answer_key",)),
    ("prompt lengths", lambda t, p, d: _prompts(t, "e.jsonl", '{"prompt": "1+2=", "answer": "3"}\n'
                                                              '{"prompt": "\u4e2d\u6587", '
                                                              '"answer": "3"}\n'.encode()),
     ("row 1 (line 2): its prompt (column 'prompt') turns into no tokens",)),
    ("prompt lengths", lambda t, p, d: _prompts(t, "o.jsonl", json.dumps(
        {"prompt": "1+" * 200 + "2=", "answer": "3"}).encode() + b"\n"),
     ("row 0's prompt has", "raise rollout.max_seq_len")),
    ("run directory", lambda t, p, d: ["--run-dir", str(_file(t, "a-file", b"mine"))],
     ("a-file: a file is there",)),
    ("run dir writable", lambda t, p, d: ["--run-dir", str(_file(t, "a-file", b"mine") / "run")],
     ("Not a directory", "a part of the path is a file")),
    ("drafter fits", lambda t, p, d: _eagle(_other_policy_drafter(t)),
     ("does not match the policy (hidden_size: drafter 32 vs policy 64",)),
    ("drafter fits", lambda t, p, d: _eagle(_int_drafter(t, d)), ("fc.weight is I32",)),
    ("drafter fits", lambda t, p, d: _eagle(_not_json_drafter(t, d)),
     ("drafter_config.json is not JSON",)),
    ("drafter fits", lambda t, p, d: [*_eagle(_specforge(t, p, int_fc=True)),
                                      "drafter.kind=eagle3"],
     ("fc.weight is torch.int32, not a float type",)),
    ("drafter fits", lambda t, p, d: [*_eagle(_specforge(t, p, {"hidden_size": "64"})),
                                      "drafter.kind=eagle3"],
     ("hidden_size is '64' in its config.json, not a number",)),
    ("drafter fits", lambda t, p, d: [*_eagle(d), "drafter.online.enabled=true",
                                      "drafter.online.loss=eagle3"],
     ("drafter.online.loss=eagle3 trains an eagle3 drafter, but the run's drafter is eagle1",)),
    ("memory plan", lambda t, p, d: ["rollout.kv_cache_gb=0.00001"],
     ("the paged KV cache holds 1 blocks", "raise rollout.kv_cache_gb")),
    ("memory plan", lambda t, p, d: ["rollout.max_batch_size=4000000"],
     ("the run's memory plan needs", "lower rollout.max_batch_size")),
]


def _dup_columns(tmp: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = tmp / "dup.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array(["1+2="]), pa.array(["3"]), pa.array(["x"])],
                                        names=["prompt", "answer", "prompt"]), path)
    return path


@pytest.mark.parametrize("check, case, expected",
                         [pytest.param(*c, id=f"{c[0]}-{i}") for i, c in enumerate(CASES)])
def test_the_dry_run_refuses_what_the_run_refuses_before_its_first_step(
        check, case, expected, char_policy, char_drafter, tmp_path, capsys):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    args = case(inputs, char_policy, char_drafter)
    capsys.readouterr()   # what building the inputs printed
    options = [a for i, a in enumerate(args) if a.startswith("--") or (
        i and args[i - 1].startswith("--"))]
    overrides = [a for a in args if a not in options]
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    base = ["run", TINY, *_fast(char_policy), *overrides, "--cache-dir", str(cache)]
    lines = [_one_line(capsys, [*base, *(options or ["--run-dir", str(run_dir)]), *extra])
             for extra in ([], ["--dry-run"])]
    for text in expected:
        assert text in lines[0], lines[0]
    if check == "memory plan":   # what is free on the machine moves between the two
        lines = [re.sub(r"\d+(\.\d+)?", "N", line) for line in lines]
    assert lines[0] == lines[1]
    assert not run_dir.exists() and not cache.exists()
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def _one_line(capsys, args: list[str]) -> str:
    """`fastdraft ARGS` exits 2 with one line, no traceback."""
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_the_run_directory_checks_are_the_dry_runs_too(char_policy, tmp_path, capsys):
    """A fresh start over a run's checkpoints, --resume without one, and a resume whose recipe
    changes what is learned: refused alike by the run and its dry run."""
    run_dir = tmp_path / "run"
    base = ["run", TINY, *_fast(char_policy), "rollout.prompts_per_step=2",
            "rollout.group_size=2", "algorithm.num_steps=1", "checkpoint.every=1",
            "logging.progress=false", "logging.dashboard=false", "--run-dir", str(run_dir)]
    empty = tmp_path / "empty"
    for extra in ([], ["--dry-run"]):
        line = _one_line(capsys, [*base[:-1], str(empty), "--resume", *extra])
        assert "--resume: no complete checkpoint in" in line
    assert not empty.exists()
    assert main(base) == 0   # a run of one step, checkpointed
    capsys.readouterr()
    for extra in ([], ["--dry-run"]):
        line = _one_line(capsys, [*base, *extra])
        assert f"{run_dir} already holds a run: pass --resume" in line
        line = _one_line(capsys, [*base, "actor.lr=1e-2", "--resume", *extra])
        assert "actor.lr" in line and "--resume-force" in line


def test_every_check_has_a_case_and_the_readme_lists_them():
    # backend, cluster address, tokenizer: tests/test_bad_input.py's cases (refused() there
    # asserts the run and the dry run alike too)
    assert {check for check, _, _ in CASES} | {"backend", "cluster address",
                                               "tokenizer"} == set(CHECKS)
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme[readme.index("#### What the dry run checks"):]
    section = section[:section.index("\n#", 1)]
    assert re.findall(r"^\d+\. \*\*([^*]+)\*\*", section, re.M) == list(CHECKS)
