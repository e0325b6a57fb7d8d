"""Local prompt loading (JSONL / parquet through ``datasets``) and atomic JSONL writing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from fastdraft.data.files import load_prompts, write_jsonl

ROWS = [
    {"question": "7+3=", "target": "0", "id": 0},
    {"question": "é unicode\nnewline", "target": "5", "id": 1},
]


def test_write_jsonl_then_load_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "prompts.jsonl"
    write_jsonl(ROWS, path)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == ROWS
    rows = load_prompts(path, prompt_key="question", answer_key="target")
    assert [r["prompt"] for r in rows] == ["7+3=", "é unicode\nnewline"]
    assert [r["answer"] for r in rows] == ["0", "5"]
    assert [r["id"] for r in rows] == [0, 1]  # other columns are kept


def test_load_parquet_written_by_datasets(tmp_path: Path) -> None:
    import datasets

    path = tmp_path / "prompts.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    rows = load_prompts(path, prompt_key="question")
    assert [r["prompt"] for r in rows] == ["7+3=", "é unicode\nnewline"]
    assert "answer" not in rows[0]


def test_load_parquet_written_by_pyarrow(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "answer": ["1", "2", "3"]}), path)
    rows = load_prompts(path, answer_key="answer", split="test")
    assert [(r["prompt"], r["answer"]) for r in rows] == [("a", "1"), ("b", "2"), ("c", "3")]


def test_missing_file_names_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        load_prompts(missing)


def test_missing_key_names_columns(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    write_jsonl(ROWS, path)
    with pytest.raises(ValueError, match=r"prompt_key='prompt'.*'question', 'target', 'id'"):
        load_prompts(path)
    with pytest.raises(ValueError, match=r"answer_key='answer'.*'question'"):
        load_prompts(path, prompt_key="question", answer_key="answer")


def test_unsupported_extension_names_supported(tmp_path: Path) -> None:
    path = tmp_path / "p.csv"
    path.write_text("prompt\na\n")
    with pytest.raises(ValueError, match=r"\.jsonl.*\.parquet"):
        load_prompts(path)


def test_write_jsonl_is_atomic_on_failure(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    write_jsonl([{"a": 1}], path)

    def rows() -> Iterator[dict[str, int]]:  # fails halfway through
        yield {"a": 2}
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        write_jsonl(rows(), path)
    assert path.read_text() == '{"a": 1}\n'  # old content intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]  # no temp file left


def test_write_jsonl_rejects_unserialisable_without_clobbering(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    write_jsonl([{"a": 1}], path)
    with pytest.raises(TypeError):
        write_jsonl([{"a": object()}], path)
    assert path.read_text() == '{"a": 1}\n'


@pytest.mark.parametrize("content, match", [
    ("", "is empty"),
    ('{"prompt": "a"}\n{"prompt": \n', r"line 2: Expecting value .*every line must be one JSON "
                                       "object"),
    ("not json at all\n", "line 1: Expecting value"),
])
def test_unreadable_prompt_files_say_what_is_wrong(tmp_path: Path, content: str, match: str):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_prompts(path)


def test_loading_leaves_nothing_in_the_datasets_cache(tmp_path: Path, monkeypatch) -> None:
    import datasets
    cache = tmp_path / "hf-datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    path = tmp_path / "p.jsonl"
    write_jsonl([{"prompt": "1+1=", "answer": "2"}], path)
    assert load_prompts(path, answer_key="answer")[0]["answer"] == "2"
    assert not cache.exists() or not any(cache.rglob("*"))
