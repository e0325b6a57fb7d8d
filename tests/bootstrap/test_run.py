"""run_bootstrap: writes a loadable policy + report atomically, caches it, retrains on force."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import fastdraft.bootstrap.run as run_mod
from fastdraft.bootstrap.determinism import weights_digest
from fastdraft.bootstrap.policy import BootstrapSpec, encode_prompt
from fastdraft.bootstrap.run import (
    BootstrapReport,
    bootstrap_dir,
    default_cache_dir,
    load_cached,
    run_bootstrap,
)
from fastdraft.engine import RolloutEngine, SamplingParams
from fastdraft.models import load_model

TINY = BootstrapSpec(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                     num_kv_heads=1, steps=4, batch_size=8, warmup_steps=1, bucket_batches=2,
                     num_heldout=8, eval_batch_size=8, max_new_tokens=16)


@pytest.fixture
def train_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts real training runs (wraps train_bootstrap as run.py calls it)."""
    calls: list[int] = []
    real = run_mod.train_bootstrap

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(run_mod, "train_bootstrap", counting)
    return calls


def _quiet(_: str) -> None:
    pass


def test_writes_loadable_policy_and_report_then_caches(tmp_path: Path, train_calls) -> None:
    lines: list[str] = []
    report = run_bootstrap(tmp_path, spec=TINY, log=lines.append)
    assert train_calls == [1] and not report.cached
    assert report.policy_dir == bootstrap_dir(tmp_path, TINY, 0) / "policy"
    assert any(str(report.policy_dir) in line for line in lines)  # the path is printed

    model = load_model(report.policy_dir)
    tok = AutoTokenizer.from_pretrained(report.policy_dir)
    assert model.config.model_type == "qwen2" and model.config.eos_token_ids == (1,)
    assert tok.eos_token_id == 1 and len(tok) <= model.config.vocab_size
    gen = json.loads((report.policy_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 1
    engine = RolloutEngine(report.policy_dir, max_seq_len=64)
    out = engine.generate([encode_prompt(tok, "1+2+3=")], SamplingParams(greedy=True,
                                                                         max_new_tokens=8))
    assert 1 <= len(out[0].token_ids) <= 8

    stored = json.loads((report.policy_dir.parent / "report.json").read_text())
    assert stored["num_heldout"] == TINY.num_heldout == report.num_heldout
    assert 0.0 <= report.heldout_accuracy_greedy <= 1.0
    assert report.num_params == sum(p.numel() for p in model.parameters())
    assert report.weights_digest == weights_digest(model)  # the digest is of the saved weights
    assert report.torch_threads == TINY.num_threads and report.cpu_capability
    assert report.reference_length_p50 <= report.reference_length_p99
    assert report.total_seconds >= report.train_seconds > 0
    assert BootstrapReport.from_json(report.to_json()) == report

    again = run_bootstrap(tmp_path, spec=TINY, log=_quiet)
    assert train_calls == [1] and again.cached
    assert again == report  # `cached` is excluded from equality


def test_force_retrains_and_reproduces_the_weights(tmp_path: Path, train_calls) -> None:
    first = run_bootstrap(tmp_path, spec=TINY, log=_quiet)
    lines: list[str] = []
    forced = run_bootstrap(tmp_path, spec=TINY, log=lines.append, force=True)
    assert train_calls == [1, 1] and not forced.cached
    assert forced.weights_digest == first.weights_digest
    assert any("equal the previous build's" in line for line in lines)
    assert load_cached(forced.policy_dir.parent) is not None
    leftovers = [p.name for p in forced.policy_dir.parent.parent.iterdir() if p.name[0] == "."]
    assert leftovers == []


def test_incomplete_or_temp_dirs_are_not_cached_results(tmp_path: Path, train_calls) -> None:
    report = run_bootstrap(tmp_path, spec=TINY, log=_quiet)
    final = report.policy_dir.parent
    # A killed run leaves only a hidden temp dir (even a full-looking one): not a cached result.
    shutil.move(final, final.with_name(f".{final.name}.tmp-killed"))
    assert load_cached(final) is None
    run_bootstrap(tmp_path, spec=TINY, log=_quiet)
    assert train_calls == [1, 1]
    # A final dir that lost its report (or weights) is incomplete: rebuilt, not reused.
    (final / "report.json").unlink()
    assert load_cached(final) is None
    rebuilt = run_bootstrap(tmp_path, spec=TINY, log=_quiet)
    assert train_calls == [1, 1, 1] and (final / "report.json").is_file()
    assert not rebuilt.cached


def test_other_seed_or_spec_is_a_different_cache_entry(tmp_path: Path, train_calls) -> None:
    a = run_bootstrap(tmp_path, spec=TINY, log=_quiet)
    b = run_bootstrap(tmp_path, spec=TINY, seed=1, log=_quiet)
    assert train_calls == [1, 1] and a.policy_dir != b.policy_dir


def test_default_cache_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FASTDRAFT_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("FASTDRAFT_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "fastdraft"
