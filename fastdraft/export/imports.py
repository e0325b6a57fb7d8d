"""Drafters from engine directories into fastdraft: an EAGLE-3 drafter in the SpecForge/SGLang
layout (config.json `architectures: ["LlamaForCausalLMEagle3"]`: what SpecForge and the EAGLE
authors publish, and fastdraft's own export), in the speculators layout (vLLM's: a config.json
with `speculators_config`), or an EAGLE-1 export. The layout is read from config.json; every way
the drafter does not fit the policy is one line naming both values, all of them in one error.

Aux layers arrive in each project's count: SGLang and SpecForge name a layer's output
(`eagle_config.eagle_aux_hidden_state_layer_ids`, SGLang adds 1), vLLM and speculators a layer's
input (`eagle_aux_hidden_state_layer_ids`), as fastdraft does. An lm_head that is the policy's
own rows (fastdraft's export) is borrowed again; any other is the drafter's own (Drafter.head)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from fastdraft.drafter import Drafter, build_drafter
from fastdraft.drafter.checkpoint import CONFIG_FILE as FASTDRAFT_CONFIG
from fastdraft.drafter.checkpoint import check_head_vocab, save_drafter
from fastdraft.errors import FastdraftError
from fastdraft.export.formats import CONFIG_FILE, EAGLE3_ARCHITECTURE, WEIGHTS_FILE
from fastdraft.export.names import from_engine_names
from fastdraft.export.speculators import as_sglang_config, rename_layer, speculators_problems
from fastdraft.export.vocab import target_ids_from_offsets, vocab_problems
from fastdraft.models import ModelConfig
from fastdraft.utils.file_digest import SUMS_FILE, check_sums

# bfloat16 keeps 8 significant bits: an lm_head exported from this policy is within this of it.
_BF16_RTOL = 2.0 ** -7
# What the drafter's layer takes from the policy, so must agree (fastdraft builds the layer
# from the policy's config).
_SAME_AS_POLICY = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
                   "head_dim", "intermediate_size", "rope_theta")


@dataclass(frozen=True)
class EngineDrafter:
    """An engine directory's drafter, checked against the policy, in fastdraft's names."""

    path: Path
    layout: str                          # "sglang" | "speculators" | "eagle1"
    kind: str
    tensors: dict[str, torch.Tensor]     # the trainable layers (fastdraft names)
    lm_head: torch.Tensor | None         # [draft vocab, H]; None: the policy's
    draft_token_ids: torch.Tensor | None
    aux_layers: tuple[int, ...] | None   # fastdraft's (vLLM's) count; None: the default


def engine_layout(path: str | Path) -> str | None:
    """"sglang", "speculators" or "eagle1" for an engine directory; None for a fastdraft
    checkpoint (drafter_config.json) or a directory with neither."""
    path = Path(path)
    if (path / FASTDRAFT_CONFIG).is_file() or not (path / CONFIG_FILE).is_file():
        return None
    config = _engine_config(path)
    if "speculators_config" in config:
        return "speculators"
    return "sglang" if config.get("architectures") == [EAGLE3_ARCHITECTURE] else "eagle1"


def _engine_config(path: Path) -> dict[str, Any]:
    """An engine directory's config.json, or one line saying it is not a JSON object."""
    try:
        config = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FastdraftError(f"{path / CONFIG_FILE} is not JSON ({err}): the drafter directory "
                             "is damaged; copy it again") from None
    if not isinstance(config, dict):
        raise FastdraftError(f"{path / CONFIG_FILE} is not a JSON object: not a drafter's config")
    return config


def read_engine_drafter(path: str | Path, policy: ModelConfig) -> EngineDrafter:
    path = Path(path)
    layout = engine_layout(path)
    if layout is None:
        raise FileNotFoundError(f"{path}: no config.json of an engine drafter there (a "
                                "SpecForge/SGLang or speculators directory)")
    if (path / SUMS_FILE).is_file():
        check_sums(path)
    config = _engine_config(path)
    tensors = load_file(str(path / WEIGHTS_FILE))
    problems: list[str] = [f"{name} is {t.dtype}, not a float type (fastdraft loads float16 / "
                           "bfloat16 / float32 weights)" for name, t in tensors.items()
                           if name not in ("d2t", "t2d") and not t.is_floating_point()]
    aux = None
    if layout == "speculators":
        problems += speculators_problems(config)
        aux = config.get("eagle_aux_hidden_state_layer_ids")
        config, tensors = as_sglang_config(config), rename_layer(tensors, to_speculators=False)
    elif layout == "sglang":
        sglang_ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        aux = None if sglang_ids is None else [i + 1 for i in sglang_ids]   # output -> input
    problems += _shape_problems(config, policy)
    tensors.pop("embed_tokens.weight", None)   # the engines take the target's too
    fc_bias = tensors.pop("fc.bias", None)
    if fc_bias is not None and bool(fc_bias.any()):
        problems.append("fc.bias is non-zero, but fastdraft's fc has no bias")
    lm_head = tensors.pop("lm_head.weight", None)
    d2t, t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
    draft_vocab = config.get("draft_vocab_size") or policy.vocab_size
    if layout != "eagle1" and draft_vocab < policy.vocab_size and d2t is None:
        problems.append(f"draft_vocab_size {draft_vocab} < the policy's vocabulary "
                        f"{policy.vocab_size}, but there is no d2t saying which token each "
                        "draft row is")
    if d2t is not None:
        problems += vocab_problems(d2t, t2d if t2d is not None else _membership(d2t, policy),
                                   policy.vocab_size)
    if aux is not None and not (len(aux) == 3 and all(
            0 <= i < policy.num_hidden_layers for i in aux)):
        problems.append(f"aux layers {list(aux)} (as layer inputs): the policy has layers "
                        f"0..{policy.num_hidden_layers - 1}")
    if problems:
        raise FastdraftError(f"drafter {path} ({layout} layout) does not fit the policy: "
                             + "; ".join(problems))
    kind = "eagle1" if layout == "eagle1" else "eagle3"
    named = from_engine_names(kind, config["architectures"][0], tensors)
    return EngineDrafter(path, layout, kind, named, lm_head,
                         None if d2t is None else target_ids_from_offsets(d2t),
                         None if aux is None else tuple(aux))


def build_engine_drafter(src: EngineDrafter, policy: ModelConfig, policy_lm_head: torch.Tensor,
                         max_positions: int) -> Drafter:
    """The drafter (fp32, on the CPU, attached to nothing): its own lm_head unless the one it
    carries is the policy's rows over its draft vocabulary."""
    ids = src.draft_token_ids
    own = src.lm_head is not None and not _is_policys(src.lm_head, policy_lm_head, ids)
    drafter = build_drafter(src.kind, policy, max_positions, aux_layers=src.aux_layers,
                            head_rows=src.lm_head.shape[0] if own else None)
    named = dict(src.tensors)
    if own:
        named["head.weight"] = src.lm_head
    expected = dict(drafter.named_parameters())
    wrong = [f"{n}: missing" for n in expected if n not in named]
    wrong += [f"{n}: shape {list(named[n].shape)}, expected {list(p.shape)}"
              for n, p in expected.items() if n in named and named[n].shape != p.shape]
    if wrong:
        raise FastdraftError(f"drafter {src.path} does not fit the policy:\n  "
                             + "\n  ".join(wrong))
    with torch.no_grad():
        for name, param in expected.items():
            param.copy_(named[name].float())
    drafter.draft_token_ids = ids
    check_head_vocab(drafter, str(src.path))
    return drafter


def import_drafter(src_dir: str | Path, policy_dir: str | Path, out_dir: str | Path,
                   overwrite: bool = False) -> Path:
    """Writes the engine directory's drafter as a fastdraft checkpoint at out_dir (atomic;
    replacing only an earlier drafter unless `overwrite`), for the policy at policy_dir."""
    from fastdraft.export.sources import read_policy_lm_head
    policy = ModelConfig.from_pretrained(policy_dir)
    src = read_engine_drafter(src_dir, policy)
    drafter = build_engine_drafter(src, policy, read_policy_lm_head(policy_dir, policy),
                                   policy.max_position_embeddings)
    save_drafter(drafter, out_dir, overwrite=overwrite,
                 extra={"imported_from": str(Path(src_dir).resolve()),
                        "imported_layout": src.layout})
    return Path(out_dir)


def _shape_problems(config: dict[str, Any], policy: ModelConfig) -> list[str]:
    problems = []
    for key in _SAME_AS_POLICY:   # head_dim: when the config says it (else hidden / heads)
        mine, theirs = config.get(key), getattr(policy, key)
        if mine is not None and (not isinstance(mine, int | float) or isinstance(mine, bool)):
            problems.append(f"{key} is {mine!r} in its config.json, not a number")
        elif mine is not None and mine != theirs:
            problems.append(f"{key}: drafter {mine}, policy {theirs}")
    positions = config.get("max_position_embeddings")
    if isinstance(positions, int) and positions < policy.max_position_embeddings:
        problems.append(f"max_position_embeddings: drafter {positions}, policy "
                        f"{policy.max_position_embeddings} (SpecForge's 2048 default left on a "
                        "long-context drafter collapses acceptance past it: set the policy's "
                        "value in its config.json if it was trained for long sequences)")
    return problems


def _membership(d2t: torch.Tensor, policy: ModelConfig) -> torch.Tensor:
    t2d = torch.zeros(policy.vocab_size, dtype=torch.bool)
    targets = target_ids_from_offsets(d2t)
    t2d[targets[(targets >= 0) & (targets < policy.vocab_size)]] = True
    return t2d


def _is_policys(lm_head: torch.Tensor, policy_lm_head: torch.Tensor,
                draft_ids: torch.Tensor | None) -> bool:
    rows = policy_lm_head.detach().cpu().float()
    rows = rows if draft_ids is None else rows[draft_ids]
    return rows.shape == lm_head.shape and torch.allclose(lm_head.float(), rows,
                                                          rtol=_BF16_RTOL, atol=1e-6)
