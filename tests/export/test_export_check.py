"""check_export catches directories an engine would refuse or misread; export_drafter never
publishes one and never replaces what is not an export."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastdraft.export import check_export, export_drafter
from fastdraft.utils.file_digest import SUMS_FILE
from tests.export.conftest import load_policy, saved_drafter

DRAFT_IDS = [9, 3, 17, 30]


@pytest.fixture(scope="module")
def exports(llama_policy_dir, tmp_path_factory) -> dict[str, Path]:
    """One valid export per variant: eagle1 sglang/vllm, eagle3 with a draft vocabulary."""
    root = tmp_path_factory.mktemp("exports")
    policy = load_policy(llama_policy_dir)
    saved_drafter(policy, "eagle1", root / "d1")
    saved_drafter(policy, "eagle3", root / "d3", draft_token_ids=DRAFT_IDS)
    sglang, vllm = export_drafter(root / "d1", llama_policy_dir, root / "e1", "all")
    eagle3, speculators = export_drafter(root / "d3", llama_policy_dir, root / "e3", "all")
    return {"sglang": sglang, "vllm": vllm, "eagle3": eagle3, "speculators": speculators}


def _altered(src: Path, dst: Path, config: Callable[[dict], None] | None = None,
             tensors: Callable[[dict], None] | None = None) -> Path:
    """A copy of an export edited by hand (so without the exporter's SHA256SUMS)."""
    shutil.copytree(src, dst)
    (dst / SUMS_FILE).unlink()
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        named = load_file(str(dst / "model.safetensors"))
        tensors(named)
        save_file(named, str(dst / "model.safetensors"))
    return dst


def test_valid_exports_pass(exports):
    check_export(exports["sglang"], "sglang", "eagle1")
    check_export(exports["vllm"], "vllm", "eagle1")
    for fmt in ("sglang", "vllm", "all"):
        check_export(exports["eagle3"], fmt, "eagle3", expected_draft_token_ids=torch.tensor(
            DRAFT_IDS))
    check_export(exports["speculators"], "speculators", "eagle3", num_layers=4,
                 expected_draft_token_ids=torch.tensor(DRAFT_IDS))


@pytest.mark.parametrize("key, reason", [
    ("fc.bias", "vLLM's EAGLE-1 fc has no bias"),
    ("layers.0.input_layernorm.weight", "no input_layernorm"),
    ("norm.weight", "no final norm"),
    ("lm_head.weight", "target's lm_head"),
])
def test_forbidden_key_fails_for_vllm(exports, tmp_path, key, reason):
    bad = _altered(exports["vllm"], tmp_path / "bad",
                   tensors=lambda t: t.update({key: torch.zeros(64, dtype=torch.bfloat16)}))
    pattern = rf"{re.escape(key)} must not be there \(.*{re.escape(reason)}"
    with pytest.raises(ValueError, match=pattern):
        check_export(bad, "vllm", "eagle1")


def test_sglang_without_fc_bias_fails(exports, tmp_path):
    bad = _altered(exports["sglang"], tmp_path / "bad", tensors=lambda t: t.pop("fc.bias"))
    with pytest.raises(ValueError, match=r"fc\.bias is missing"):
        check_export(bad, "sglang", "eagle1")


def test_embed_tokens_fails_for_eagle3(exports, tmp_path):
    bad = _altered(exports["eagle3"], tmp_path / "bad", tensors=lambda t: t.update(
        {"embed_tokens.weight": torch.zeros(64, 64, dtype=torch.bfloat16)}))
    with pytest.raises(ValueError, match=r"embed_tokens\.weight must not be there"):
        check_export(bad, "all", "eagle3")


def test_missing_d2t_with_reduced_vocab_fails(exports, tmp_path):
    bad = _altered(exports["eagle3"], tmp_path / "bad", tensors=lambda t: t.pop("d2t"))
    with pytest.raises(ValueError, match="d2t is missing"):
        check_export(bad, "all", "eagle3")


def test_d2t_disagreeing_with_t2d_or_the_drafter_fails(exports, tmp_path):
    def shift_last(t):
        t["d2t"][-1] += 1  # draft token 3 now names target 31, which t2d does not mark

    bad = _altered(exports["eagle3"], tmp_path / "bad", tensors=shift_last)
    with pytest.raises(ValueError, match="t2d and d2t name different target tokens"):
        check_export(bad, "all", "eagle3")
    with pytest.raises(ValueError, match="not the drafter's draft_token_ids"):
        check_export(exports["eagle3"], "all", "eagle3",
                     expected_draft_token_ids=torch.tensor([3, 9, 17, 30]))


def test_missing_draft_vocab_size_fails(exports, tmp_path):
    bad = _altered(exports["eagle3"], tmp_path / "bad", config=lambda c: c.pop("draft_vocab_size"))
    with pytest.raises(ValueError, match="draft_vocab_size is missing"):
        check_export(bad, "all", "eagle3")


@pytest.mark.parametrize("variant, fmt, kind, architecture", [
    ("vllm", "vllm", "eagle1", "LlamaForCausalLMEagle"),   # vLLM does not know it
    ("sglang", "sglang", "eagle1", "LlamaForCausalLM"),
    ("eagle3", "all", "eagle3", "LlamaForCausalLMEagle"),
])
def test_wrong_architecture_fails(exports, tmp_path, variant, fmt, kind, architecture):
    bad = _altered(exports[variant], tmp_path / "bad",
                   config=lambda c: c.update(architectures=[architecture]))
    with pytest.raises(ValueError, match=rf"architectures is \['{architecture}'\]"):
        check_export(bad, fmt, kind)


def test_wrong_shape_and_kind_fail(exports, tmp_path):
    bad = _altered(exports["vllm"], tmp_path / "bad", tensors=lambda t: t.update(
        {"fc.weight": torch.zeros(64, 192, dtype=torch.bfloat16)}))
    with pytest.raises(ValueError, match=r"fc\.weight has shape \[64, 192\], expected \[64, 128\]"):
        check_export(bad, "vllm", "eagle1")
    with pytest.raises(ValueError, match="architectures is"):
        check_export(exports["eagle3"], "vllm", "eagle1")
    with pytest.raises(ValueError, match="no EAGLE-1 directory serves both engines"):
        check_export(exports["vllm"], "all", "eagle1")
    with pytest.raises(ValueError, match=r"config\.json"):
        check_export(tmp_path, "vllm", "eagle1")


def test_export_replaces_an_earlier_export_but_nothing_else(llama_policy_dir, exports, tmp_path):
    drafter_dir = exports["sglang"].parent.parent / "d1"
    out = tmp_path / "out"
    (out / "vllm").mkdir(parents=True)
    (out / "vllm" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="1 entry fastdraft did not write"):
        export_drafter(drafter_dir, llama_policy_dir, out, "all")
    assert (out / "vllm" / "notes.txt").read_text() == "mine" and not (out / "sglang").exists()
    [first] = export_drafter(drafter_dir, llama_policy_dir, out, "sglang")
    [again] = export_drafter(drafter_dir, llama_policy_dir, out, "sglang")
    assert first == again == out / "sglang"
    check_export(again, "sglang", "eagle1")
    assert sorted(p.name for p in out.iterdir()) == ["sglang", "vllm"]  # no temp dirs left


def test_an_export_damaged_on_disk_is_named_by_the_check(exports, tmp_path):
    bad = tmp_path / "damaged"
    shutil.copytree(exports["eagle3"], bad)
    weights = bad / "model.safetensors"
    with weights.open("r+b") as f:       # same size, bytes inside a tensor
        f.seek(weights.stat().st_size - 8)
        f.write(b"\x7f" * 8)
    with pytest.raises(ValueError, match=r"model\.safetensors: its bytes differ"):
        check_export(bad, "all", "eagle3")
