"""The recipe the rollout-batch benches' tests share: 4 prompts x 4 samples on the char policy
with an EAGLE tree, plus whatever rollout keys a test adds."""

from __future__ import annotations

from pathlib import Path


def eagle_rollout_recipe(tmp_path: Path, policy: Path, drafter: Path,
                         rollout_extra: str = "") -> Path:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nmodel:\n  path: {policy}\ndrafter:\n  path: {drafter}\n"
                      "rollout:\n  prompts_per_step: 4\n  group_size: 4\n  max_new_tokens: 12\n"
                      "  max_batch_size: 16\n  spec:\n    method: eagle\n    depth: 3\n"
                      "    topk: 2\n    tokens_to_verify: 4\n" + rollout_extra)
    return recipe
