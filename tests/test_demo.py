"""The default drafter beside the policy is reused only while it matches today's warm-up
settings; a stale one that fastdraft warmed up itself is re-trained (a bench must not measure an
outdated drafter silently), one the user warmed up there is kept."""

from __future__ import annotations

import json
from dataclasses import asdict

import fastdraft.drafter.warmup as warmup_mod
from fastdraft import demo
from fastdraft.drafter.warmup import WarmupConfig


def _fake_drafter(out, warmup: dict, auto: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = {"kind": "eagle1", "warmup": warmup} | ({demo.AUTO_WARMED: True} if auto else {})
    (out / "drafter_config.json").write_text(json.dumps(meta))


def test_ensure_drafter_reuses_a_current_one_and_retrains_a_stale_one(tmp_path, monkeypatch):
    policy = tmp_path / "policy"
    calls = []
    monkeypatch.setattr(warmup_mod, "warmup_drafter",
                        lambda policy_dir, out, prompts, cfg, **_: calls.append((out, cfg)))
    monkeypatch.setattr(demo, "prompt_ids", lambda *a, **k: [[1, 2]])
    out = demo.default_drafter_dir(policy, "eagle1")
    _fake_drafter(out, asdict(WarmupConfig(kind="eagle1")))
    assert demo.ensure_drafter(policy, None) == out and calls == []

    stale = asdict(WarmupConfig(kind="eagle1")) | {"steps": 1500}
    _fake_drafter(out, stale)
    assert demo.ensure_drafter(policy, None) == out
    assert len(calls) == 1 and calls[0][1] == WarmupConfig(kind="eagle1")

    # A drafter saved when the unrolled-steps default was left unresolved (None) is stale too.
    _fake_drafter(out, asdict(WarmupConfig(kind="eagle1")) | {"ttt_steps": None})
    demo.ensure_drafter(policy, None)
    assert len(calls) == 2

    explicit = tmp_path / "mine"
    assert demo.ensure_drafter(policy, explicit) == explicit and len(calls) == 2


def test_ensure_drafter_warms_up_a_missing_one(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(warmup_mod, "warmup_drafter",
                        lambda policy_dir, out, prompts, cfg, **_: calls.append(out))
    monkeypatch.setattr(demo, "prompt_ids", lambda *a, **k: [[1, 2]])
    out = demo.ensure_drafter(tmp_path / "policy", None, kind="eagle3")
    assert calls == [out] and out.name == "drafter-eagle3"


def test_ensure_drafter_keeps_a_drafter_the_user_warmed_up(tmp_path, monkeypatch, capsys):
    """`fastdraft drafter warmup --argmax-weight 0.5` without --out writes the default dir: a
    later bench uses that drafter (and says so) instead of training over it."""
    policy = tmp_path / "policy"
    calls = []
    monkeypatch.setattr(warmup_mod, "warmup_drafter", lambda *a, **k: calls.append(a))
    out = demo.default_drafter_dir(policy, "eagle1")
    _fake_drafter(out, asdict(WarmupConfig(kind="eagle1", argmax_weight=0.5)), auto=False)
    assert demo.ensure_drafter(policy, None) == out and calls == []
    assert "other than today's defaults" in capsys.readouterr().out


def test_warmup_drafter_records_extra_meta(tmp_path, tiny_checkpoint):
    path, _ = tiny_checkpoint
    cfg = WarmupConfig(num_rollouts=2, max_new_tokens=4, steps=2, batch_size=2, warmup_steps=0)
    warmup_mod.warmup_drafter(path, tmp_path / "d", [[3, 4, 5], [6, 7]], cfg, log=lambda _: None,
                              meta={demo.AUTO_WARMED: True})
    meta = json.loads((tmp_path / "d" / "drafter_config.json").read_text())
    assert meta[demo.AUTO_WARMED] is True and meta["warmup"] == asdict(cfg)


def test_verdict_names_what_the_verifier_found():
    from fastdraft.data.tasks.modsum import ModSumTask, make_problem
    from fastdraft.engine import FinishReason
    task, problem = ModSumTask(), make_problem([7, 3, 9, 4])   # answer 3
    assert demo.verdict(task, problem, "7,0,9,3#3", FinishReason.STOP) == "correct"
    assert demo.verdict(task, problem, "7,0,9,3#3,1,1", FinishReason.LENGTH) == "correct"
    assert demo.verdict(task, problem, "7,0,9,2#2", FinishReason.STOP) == "wrong"
    assert demo.verdict(task, problem, "7,0,9,3", FinishReason.STOP) == "wrong"   # no answer
    assert demo.verdict(task, problem, "7,0,9,3#1", FinishReason.LENGTH) == "wrong"
    assert demo.verdict(task, problem, "7,0,9,3,5,5", FinishReason.LENGTH) == "unfinished"


def _generate_args(**overrides):
    import argparse
    return argparse.Namespace(**{"model": None, "cache_dir": None, "prompts": None,
                                 "num_prompts": 4, "temperature": 1.0, "top_p": 1.0,
                                 "max_new_tokens": 6, "seed": 0, **overrides})


def test_generate_explains_the_task_the_weak_policy_and_its_verdicts(char_policy, monkeypatch,
                                                                     capsys):
    """The bootstrap's prompts: a header says what they are, that the policy is weak on purpose
    and what a verdict means; each sample starts with one; the summary counts them."""
    monkeypatch.setattr(demo, "resolve_model", lambda *a, **k: char_policy)  # as the bootstrap
    assert demo.generate_demo(_generate_args()) == 0
    out = capsys.readouterr().out.splitlines()
    header = "\n".join(line for line in out if line.split(":")[0] in ("prompts", "policy",
                                                                        "verdict"))
    for words in ("held-out problems of modsum, the bootstrap's synthetic task", "mod 10",
                  "weak at modsum by design", "fastdraft run recipes/tiny-grpo.yaml",
                  "correct =", "wrong =", "unfinished =", "--max-new-tokens (6)"):
        assert words in header, words
    samples = [line for line in out if line.split(" ")[0] in demo.VERDICTS]
    assert len(samples) == 4
    # An untrained policy given 6 tokens: most samples end without an answer.
    assert any(line.startswith("unfinished ") and "length]" in line for line in samples)
    counts = {v: sum(line.split(" ")[0] == v for line in samples) for v in demo.VERDICTS}
    summary = next(line for line in out if line.startswith("verdicts: "))
    assert summary.startswith(f"verdicts: {counts['correct']} correct, {counts['wrong']} wrong, "
                              f"{counts['unfinished']} unfinished; reward mean")


def test_generate_on_a_prompt_file_says_once_that_there_is_no_verifier(char_policy, tmp_path,
                                                                       capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+2="}\n{"prompt": "3+4+5="}\n')
    assert demo.generate_demo(_generate_args(model=char_policy, prompts=prompts)) == 0
    out = capsys.readouterr().out
    assert out.count("no verifier") == 1 and "weak at" not in out
    assert not any(line.split(" ")[0] in demo.VERDICTS for line in out.splitlines())
    assert not any(line.startswith("verdicts:") for line in out.splitlines())
