"""A user's mistakes, each refused before any work: exit 2, one line naming the file / row / key
and what to change, nothing written under the run dir or the cache, no process left behind, and
the same verdict from `--dry-run` (run/preflight.py: one function both call)."""

from __future__ import annotations

import importlib.util
import shutil
import socket
from pathlib import Path

import psutil
import pytest

from fastdraft.cli import main

TINY = str(Path(__file__).parents[1] / "recipes" / "tiny-grpo.yaml")
FILE_PROMPTS = ["data.task=null", "data.task_options=null", "data.task_pool=null",
                "rollout.max_seq_len=300"]


def refused(capsys, tmp_path: Path, args: list[str], *expected: str, dry: bool = True) -> str:
    """Runs `fastdraft ARGS` (and with --dry-run): both exit 2 with the same one line holding
    every `expected` text; nothing written, nothing left running. Returns the line."""
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    lines = []
    for extra in (["--run-dir", str(run_dir)], ["--dry-run"]) if dry else ([],):
        code = main([*args, "--cache-dir", str(cache), *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2, err
        assert len(err) == 1, err
        for text in expected:
            assert text in err[0], err[0]
        lines.append(err[0])
    assert len(set(lines)) == 1, lines
    assert not run_dir.exists() and not cache.exists()
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    return lines[0]


def _prompt_file(tmp_path: Path, text: str, name: str = "p.jsonl") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, expected", [
    ('{"prompt":"1+2=","answer":"3"}\n{"prompt":"2+2="}\n',
     ["row 1 (line 2)", "answer (column 'answer') has none"]),
    ('{"prompt":"1+2=","answer":"3"}\n\n{"prompt":null,"answer":"4"}\n',
     ["row 1 (line 3)", "prompt (column 'prompt') has none"]),
    ('{"prompt":"1+2=","answer":""}\n', ["row 0 (line 1)", "answer (column 'answer') is empty"]),
    ('{"prompt":"  \\n","answer":"3"}\n', ["row 0 (line 1)", "is only whitespace"]),
    ('{"prompt":"1+2=","answer":3}\n', ["row 0 (line 1)", "its answer (column 'answer') is 3, "
                                        "not text"]),
    ('{"prompt":"1+2=","answer":"3"}\n{"prompt":"2+2=",\n',
     ["line 2: Expecting property name", "one JSON object"]),
])
def test_a_broken_prompt_row_is_named_and_nothing_trains(tmp_path, capsys, text, expected):
    path = _prompt_file(tmp_path, text)
    line = refused(capsys, tmp_path, ["run", TINY, *FILE_PROMPTS, f"data.path={path}"],
                   *expected)
    assert str(path) in line


def test_a_parquet_row_is_named_by_its_row(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"q": ["a", "b", "c"], "a": ["1", None, "3"]}), path)
    refused(capsys, tmp_path, ["run", TINY, *FILE_PROMPTS, f"data.path={path}",
                               "data.prompt_key=q", "data.answer_key=a"],
            f"{path}: row 1: its answer (column 'a') has none")


@pytest.mark.parametrize("text", ["", "# only a comment\n", "\n\n"])
def test_an_empty_recipe_is_refused(tmp_path, capsys, text):
    recipe = _prompt_file(tmp_path, text, "r.yaml")
    refused(capsys, tmp_path, ["run", str(recipe)], f"recipe {recipe} is empty")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_ray_address_where_nothing_listens_is_one_line_at_once(tmp_path, capsys):
    address = f"127.0.0.1:{_free_port()}"
    refused(capsys, tmp_path, ["run", TINY, "cluster.backend=ray", f"cluster.address={address}"],
            f"cluster.address={address}: no Ray cluster there (connection refused",
            "`ray status`", "RAY_AUTH_MODE=token")


def test_a_ray_address_that_never_answers_waits_connect_timeout_s_then_says_so(monkeypatch):
    from fastdraft.cluster.ray_cluster import check_address
    from fastdraft.config.sections import ClusterConfig
    from fastdraft.errors import FastdraftError
    calls = []

    def silent(address, timeout):
        calls.append(timeout)
        raise TimeoutError
    monkeypatch.setattr(socket, "create_connection", silent)
    cfg = ClusterConfig(backend="ray", address="ray://127.0.0.1:10001", connect_timeout_s=0.3)
    with pytest.raises(FastdraftError, match=r"no answer within cluster.connect_timeout_s=0.3"):
        check_address(cfg)
    assert calls and max(calls) <= 0.3


def test_a_listening_ray_address_passes_the_check_and_a_malformed_one_is_named():
    from fastdraft.cluster.ray_cluster import check_address
    from fastdraft.config.sections import ClusterConfig
    from fastdraft.errors import FastdraftError
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_address(ClusterConfig(backend="ray", address=f"127.0.0.1:"
                                    f"{server.getsockname()[1]}"))
    with pytest.raises(FastdraftError, match="not HOST:PORT"):
        check_address(ClusterConfig(backend="ray", address="headnode"))


def test_more_actor_ranks_than_cores_are_refused_before_any_is_spawned(tmp_path, capsys):
    refused(capsys, tmp_path, ["run", TINY, "actor.num_ranks=64", "actor.micro_batch_tokens=512"],
            "actor.num_ranks=64, but this machine has", "CPU core(s)",
            "set actor.num_ranks to at most")


def test_plain_decoding_with_the_online_drafter_names_the_setting_to_change(tmp_path, capsys):
    refused(capsys, tmp_path, ["run", TINY, "rollout.spec.method=none"],
            "rollout.spec.method=none serves none", "add drafter.online.enabled=false")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_the_vllm_backend_without_vllm_is_a_user_error(tmp_path, capsys):
    refused(capsys, tmp_path, ["run", TINY, "rollout.backend=vllm", "drafter.kind=eagle3"],
            "vLLM is not installed in this Python environment", "scripts/setup-vllm.sh")


def _copy_policy(char_policy: Path, tmp_path: Path, drop: tuple[str, ...] = ()) -> Path:
    out = tmp_path / "policy"
    shutil.copytree(char_policy, out)
    for name in drop:
        (out / name).unlink(missing_ok=True)
    return out


def test_a_policy_without_tokenizer_files_is_named(char_policy, tmp_path, capsys):
    policy = _copy_policy(char_policy, tmp_path, ("tokenizer.json", "tokenizer_config.json",
                                                   "special_tokens_map.json"))
    refused(capsys, tmp_path, ["run", TINY, f"model.path={policy}"],
            f"model.path {policy}: no tokenizer files there")


def test_a_tokenizer_that_makes_no_tokens_is_refused(char_policy, tmp_path):
    """transformers builds an empty tokenizer for a directory without its files, silently;
    the policy the run resolves (a bootstrap policy in a damaged cache) is proven to encode."""
    from fastdraft.errors import FastdraftError
    from fastdraft.run.inputs import load_tokenizer
    assert load_tokenizer(char_policy, "model.path").encode("1 + 2")
    policy = _copy_policy(char_policy, tmp_path, ("tokenizer.json", "tokenizer_config.json",
                                                   "special_tokens_map.json"))
    with pytest.raises(FastdraftError, match=f"the policy {policy}: its tokenizer turns text "
                                             "into no tokens"):
        load_tokenizer(policy, "the policy")


def test_a_truncated_weight_file_is_named_as_damaged(char_policy, tmp_path, capsys):
    policy = _copy_policy(char_policy, tmp_path)
    weights = policy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    refused(capsys, tmp_path, ["run", TINY, f"model.path={policy}"],
            f"{weights} is damaged (5000 bytes, its header describes")
    refused(capsys, tmp_path, ["generate", "--model", str(policy)], f"{weights} is damaged",
            dry=False)


def test_an_unsupported_architecture_is_said_first(tmp_path, capsys):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text('{"model_type": "gpt2", "n_embd": 768}')
    refused(capsys, tmp_path, ["run", TINY, f"model.path={gpt2}"],
            f"model.path {gpt2}: config.json: model_type 'gpt2' is not supported")
    refused(capsys, tmp_path, ["drafter", "warmup", "--policy", str(gpt2)],
            f"--policy {gpt2}: config.json: model_type 'gpt2' is not supported", dry=False)


def test_a_directory_given_as_the_recipe_lists_its_recipes(tmp_path, capsys):
    recipes = str(Path(TINY).parent)
    refused(capsys, tmp_path, ["run", recipes], f"recipe {recipes} is a directory",
            "tiny-grpo.yaml")


def test_a_key_without_its_section_is_found_in_the_sections(tmp_path, capsys):
    refused(capsys, tmp_path, ["run", TINY, "group_size=4"],
            "unknown recipe key 'group_size'; did you mean 'rollout.group_size'?")
    refused(capsys, tmp_path, ["run", TINY, "lr=1e-4"], "'actor.lr' or 'drafter.online.lr'")


def test_null_clears_a_mapping_and_the_task_error_names_the_overrides(tmp_path, capsys):
    from fastdraft.config import load_recipe
    cfg = load_recipe(TINY, ["data.task=null", "data.task_options=null", "data.task_pool=null",
                             "data.path=x.jsonl"])
    assert cfg.data.task_options == {} and cfg.data.task is None
    refused(capsys, tmp_path, ["run", TINY, "data.task=null", "data.path=x.jsonl"],
            "data.task_options=null data.task_pool=null")


def test_run_without_a_recipe_asks_for_one(tmp_path, capsys):
    refused(capsys, tmp_path, ["run"], "name a recipe: fastdraft run RECIPE.yaml", dry=False)


def test_bench_help_groups_the_options_by_bench(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    sections = [line for line in out.splitlines() if line and not line.startswith(" ")]
    for title in ("spec:", "gpu:", "recipe:", "cluster:", "kv:"):
        assert any(s.startswith(title) for s in sections), sections
    gpu = out[out.index("\ngpu:"):out.index("\nrecipe:")]
    assert "--shape" in gpu and "--methods" not in gpu


def _latin1(tmp_path: Path) -> Path:
    return _prompt_file_bytes(tmp_path, '{"prompt": "caf\xe9 1+2=", "answer": "3"}\n'
                              .encode("latin-1"))


def _prompt_file_bytes(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("args, expected", [
    (["generate", "--num-prompts", "0"], "--num-prompts and --max-new-tokens must be >= 1"),
    (["generate", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["bench", "engine", "--device", "cuda"], "--device cuda, but this torch"),
    (["bench", "engine", "--device", "gpu"], "--device must be cpu, cuda or cuda:N"),
    (["bench", "spec", "--depth", "-1"], "--depth, --topk and --tokens-to-verify must be >= 1"),
    (["drafter", "warmup", "--kind", "eagle9", "--steps", "10"], "unknown drafter kind 'eagle9'"),
])
def test_other_commands_refuse_bad_options_before_any_work(tmp_path, capsys, args, expected):
    """Each before a policy is bootstrapped or a drafter warmed up (minutes): the cache stays
    empty."""
    refused(capsys, tmp_path, args, expected, dry=False)


def test_a_latin1_prompt_file_is_named_as_such_by_run_and_generate(char_policy, tmp_path,
                                                                   capsys):
    path = _latin1(tmp_path)
    refused(capsys, tmp_path, ["run", TINY, *FILE_PROMPTS, f"model.path={char_policy}",
                               "rollout.spec.method=none", "drafter.online.enabled=false",
                               f"data.path={path}"], "is not UTF-8 text: line 1 has the byte 0xe9")
    refused(capsys, tmp_path, ["generate", "--model", str(char_policy), "--prompts", str(path)],
            "is not UTF-8 text", dry=False)


def test_a_short_warmup_scales_its_lr_ramp_instead_of_naming_a_hidden_setting():
    from fastdraft.drafter.warmup import WarmupConfig
    assert WarmupConfig.for_steps(steps=10).warmup_steps == 1
    assert WarmupConfig.for_steps(steps=4000).warmup_steps == 50 == WarmupConfig().warmup_steps
