"""The end of a run says loudly whether its drafter was exported, where to, and if not, why and
how to retry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fastdraft.drafter import LayerLayout, build_drafter, save_drafter
from fastdraft.drafter.layout import LAYOUT_KEY
from fastdraft.export.run_export import export_run_drafter
from fastdraft.models import load_model
from fastdraft.utils.file_digest import SUMS_FILE
from tests.conftest import make_tiny_checkpoint


@pytest.fixture(scope="module")
def qwen3_policy(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen3-policy")
    make_tiny_checkpoint(path, model_type="qwen3", head_dim=16, num_hidden_layers=4)
    return path


def _run_dir_with_drafter(policy_dir: Path, tmp_path: Path, kind: str,
                          legacy: bool = False) -> Path:
    """A run directory holding the drafter Run.finish saves (legacy: as an older fastdraft
    wrote it, its layer copying the target's QK-norm)."""
    policy = load_model(policy_dir, max_positions=32)
    torch.manual_seed(0)
    layout = LayerLayout.of(policy.config) if legacy else None
    save_drafter(build_drafter(kind, policy.config, 32, layout).attach(policy),
                 tmp_path / "run" / "drafter")
    if legacy:
        meta_file = tmp_path / "run" / "drafter" / "drafter_config.json"
        meta = json.loads(meta_file.read_text())
        del meta[LAYOUT_KEY]
        meta_file.write_text(json.dumps(meta))
        (meta_file.parent / SUMS_FILE).unlink()   # nor did it keep digests
    return tmp_path / "run"


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_an_exported_drafter_is_reported_with_its_directories(qwen3_policy, tmp_path, kind):
    run = _run_dir_with_drafter(qwen3_policy, tmp_path, kind)
    outcome = export_run_drafter(run, kind, qwen3_policy, export=True)
    report = outcome.report()
    assert outcome.exported and report.splitlines()[1].startswith("DRAFTER EXPORTED")
    if kind == "eagle3":
        assert outcome.written == {run / "export" / "sglang": ("sglang", "vllm"),
                                   run / "export" / "speculators": ("vllm",)}
        assert f"SGLang and vLLM: {run / 'export' / 'sglang'}" in report
        assert f"vLLM (speculators layout): {run / 'export' / 'speculators'}" in report
    else:
        assert outcome.written == {run / "export" / "sglang": ("sglang",),
                                   run / "export" / "vllm": ("vllm",)}
        assert f"SGLang: {run / 'export' / 'sglang'}" in report
        assert f"vLLM: {run / 'export' / 'vllm'}" in report
    for path in outcome.written:
        assert (path / "config.json").is_file()


def test_a_refused_export_says_why_and_how_to_retry(qwen3_policy, tmp_path):
    run = _run_dir_with_drafter(qwen3_policy, tmp_path, "eagle3", legacy=True)
    outcome = export_run_drafter(run, "eagle3", qwen3_policy, export=True)
    report = outcome.report()
    assert not outcome.exported and not (run / "export").exists()
    assert report.splitlines()[1].startswith("DRAFTER NOT EXPORTED: the eagle3 drafter")
    assert "has QK-norm" in report and "fastdraft drafter warmup" in report
    assert f"with: fastdraft export --run {run}" in report


@pytest.mark.parametrize("policy, export, reason", [
    (None, True, "no complete checkpoint"),
    ("policy", False, "drafter.export is false"),
])
def test_no_export_without_a_checkpoint_or_when_switched_off(qwen3_policy, tmp_path, policy,
                                                             export, reason):
    run = _run_dir_with_drafter(qwen3_policy, tmp_path, "eagle1")
    outcome = export_run_drafter(run, "eagle1", qwen3_policy if policy else None,
                                 export=export)
    assert not outcome.exported and not (run / "export").exists()
    assert f"DRAFTER NOT EXPORTED: {reason}" in outcome.report()
    assert f"with: fastdraft export --run {run}" in outcome.report()
