"""The two inputs of an export, read without building the policy: the drafter checkpoint
(`drafter_config.json` + `model.safetensors`) and, for EAGLE-3, the policy's lm_head, which
fastdraft drafters borrow but an EAGLE-3 export must carry. Reading one tensor from the policy's
shards keeps exporting a drafter for a large policy cheap."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fastdraft.drafter import DRAFTERS, build_drafter
from fastdraft.drafter.checkpoint import CONFIG_FILE, WEIGHTS_FILE, saved_options
from fastdraft.drafter.layout import LayerLayout, saved_layout
from fastdraft.errors import FastdraftError
from fastdraft.models import ModelConfig
from fastdraft.utils.file_digest import check_sums

# Fields whose disagreement means the drafter's weights do not fit the target's layout (or, for
# num_hidden_layers, that EAGLE-3 read other aux layers than the engines will capture).
MUST_MATCH = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")


@dataclass(frozen=True)
class DrafterCheckpoint:
    path: Path
    kind: str
    trained_for: ModelConfig
    layout: LayerLayout             # its decoder layer's switches (layout.py)
    tensors: dict[str, torch.Tensor]
    draft_token_ids: torch.Tensor | None
    options: dict                   # build_drafter's options (drafter/checkpoint.saved_options)

    def aux_layers(self, policy: ModelConfig) -> tuple[int, ...]:
        """The policy layers whose inputs it reads (EAGLE-3; vLLM's count)."""
        with torch.device("meta"):
            return tuple(build_drafter(self.kind, policy, 1, **self.options).aux_layers)


def read_drafter_checkpoint(drafter_dir: str | Path) -> DrafterCheckpoint:
    drafter_dir = Path(drafter_dir)
    if not (drafter_dir / CONFIG_FILE).is_file() or not (drafter_dir / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{drafter_dir} is not a drafter checkpoint: it needs "
                                f"{CONFIG_FILE} and {WEIGHTS_FILE} (written by `fastdraft "
                                "drafter warmup` or save_drafter)")
    check_sums(drafter_dir)
    meta = json.loads((drafter_dir / CONFIG_FILE).read_text())
    ids = meta.get("draft_token_ids")
    return DrafterCheckpoint(
        path=drafter_dir,
        kind=meta["kind"],
        trained_for=ModelConfig.from_hf_dict(meta["policy_config"]),
        layout=saved_layout(meta),
        tensors=load_file(str(drafter_dir / WEIGHTS_FILE)),
        draft_token_ids=None if ids is None else torch.tensor(ids, dtype=torch.long),
        options=saved_options(meta))


def check_fits_policy(ckpt: DrafterCheckpoint, policy: ModelConfig) -> None:
    """Refuses a drafter trained for a differently shaped target: the export takes its
    config.json from the target, so the weights must have exactly the target's shapes."""
    mismatches = [f"{f}: drafter {getattr(ckpt.trained_for, f)} vs target {getattr(policy, f)}"
                  for f in MUST_MATCH if getattr(ckpt.trained_for, f) != getattr(policy, f)]
    if mismatches:
        raise FastdraftError("the drafter was trained for another target "
                             f"({'; '.join(mismatches)})")
    _check_layout(ckpt, policy)
    with torch.device("meta"):  # names and shapes only, no memory
        expected = {n: t.shape for n, t in
                    build_drafter(ckpt.kind, policy, 1, **ckpt.options).state_dict().items()}
    wrong = [f"{n}: missing" for n in expected if n not in ckpt.tensors]
    wrong += [f"{n}: not a {ckpt.kind} parameter" for n in ckpt.tensors if n not in expected]
    wrong += [f"{n}: shape {list(t.shape)}, expected {list(expected[n])}"
              for n, t in ckpt.tensors.items() if n in expected and t.shape != expected[n]]
    if wrong:
        raise FastdraftError(f"the {ckpt.kind} drafter checkpoint does not fit the target: "
                             f"{'; '.join(wrong[:5])}")


def _check_layout(ckpt: DrafterCheckpoint, policy: ModelConfig) -> None:
    """Refuses a drafter whose layer the engines cannot hold: every drafter fastdraft builds now
    has its kind's layout, but one saved before drafters had their own copied the target's
    biases / QK-norm (layout.py), and no engine format has a place for those."""
    wanted = DRAFTERS[ckpt.kind].layer_layout(policy)
    if ckpt.layout == wanted:
        return
    raise FastdraftError(
        f"the {ckpt.kind} drafter at {ckpt.path} cannot be exported: its decoder layer "
        f"{' and '.join(ckpt.layout.differences(wanted))}, but the engines' {ckpt.kind} layer "
        f"for a {policy.model_type} target has {wanted.describe()} (the drafter was saved by "
        "an older fastdraft, which copied the target's layer switches into the drafter). It "
        "still runs in fastdraft's engine; to get an exportable one, warm up a new drafter "
        f"(`fastdraft drafter warmup --policy POLICY_DIR --kind {ckpt.kind} --out DIR`) and "
        "train it on with `fastdraft run ... drafter.path=DIR`")


def _shard_holding(policy_dir: Path, name: str) -> Path | None:
    index = policy_dir / "model.safetensors.index.json"
    if index.is_file():
        shard = json.loads(index.read_text())["weight_map"].get(name)
        return None if shard is None else policy_dir / shard
    for path in sorted(policy_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            if name in f.keys():  # noqa: SIM118 (safe_open is no dict)
                return path
    return None


def read_policy_lm_head(policy_dir: str | Path, policy: ModelConfig) -> torch.Tensor:
    """The target's lm_head [vocab, hidden]; a tied checkpoint stores it as the embedding."""
    policy_dir = Path(policy_dir)
    names = ["lm_head.weight"] + (["model.embed_tokens.weight"]
                                  if policy.tie_word_embeddings else [])
    for name in names:
        shard = _shard_holding(policy_dir, name)
        if shard is not None:
            with safe_open(str(shard), framework="pt") as f:
                weight = f.get_tensor(name)
            if weight.shape != (policy.vocab_size, policy.hidden_size):
                raise FastdraftError(f"{name} in {policy_dir} has shape {list(weight.shape)}, "
                                     f"expected [{policy.vocab_size}, {policy.hidden_size}]")
            return weight
    raise FastdraftError(f"{policy_dir} holds no {' or '.join(names)}: an EAGLE-3 export must "
                         "carry the target's lm_head")
