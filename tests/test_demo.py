"""The default drafter beside the policy is reused only while it matches today's warm-up
settings; a stale one is re-trained (a bench must not measure an outdated drafter silently)."""

from __future__ import annotations

import json
from dataclasses import asdict

import fastdraft.drafter.warmup as warmup_mod
from fastdraft import demo
from fastdraft.drafter.warmup import WarmupConfig


def _fake_drafter(out, warmup: dict) -> None:
    out.mkdir(parents=True)
    (out / "drafter_config.json").write_text(json.dumps({"kind": "eagle1", "warmup": warmup}))


def test_ensure_drafter_reuses_a_current_one_and_retrains_a_stale_one(tmp_path, monkeypatch):
    policy = tmp_path / "policy"
    calls = []
    monkeypatch.setattr(warmup_mod, "warmup_drafter",
                        lambda policy_dir, out, prompts, cfg: calls.append((out, cfg)))
    monkeypatch.setattr(demo, "prompt_ids", lambda *a, **k: [[1, 2]])
    out = demo.default_drafter_dir(policy, "eagle1")
    _fake_drafter(out, asdict(WarmupConfig(kind="eagle1")))
    assert demo.ensure_drafter(policy, None) == out and calls == []

    stale = asdict(WarmupConfig(kind="eagle1")) | {"steps": 1500}
    (out / "drafter_config.json").write_text(json.dumps({"kind": "eagle1", "warmup": stale}))
    assert demo.ensure_drafter(policy, None) == out
    assert len(calls) == 1 and calls[0][1] == WarmupConfig(kind="eagle1")

    # A drafter saved when the unrolled-steps default was left unresolved (None) is stale too.
    unresolved = asdict(WarmupConfig(kind="eagle1")) | {"ttt_steps": None}
    (out / "drafter_config.json").write_text(json.dumps({"kind": "eagle1", "warmup": unresolved}))
    demo.ensure_drafter(policy, None)
    assert len(calls) == 2

    explicit = tmp_path / "mine"
    assert demo.ensure_drafter(policy, explicit) == explicit and len(calls) == 2


def test_ensure_drafter_warms_up_a_missing_one(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(warmup_mod, "warmup_drafter",
                        lambda policy_dir, out, prompts, cfg: calls.append(out))
    monkeypatch.setattr(demo, "prompt_ids", lambda *a, **k: [[1, 2]])
    out = demo.ensure_drafter(tmp_path / "policy", None, kind="eagle3")
    assert calls == [out] and out.name == "drafter-eagle3"
