"""Drafter checkpoints: `drafter_config.json` (kind, the policy shape it was trained for, its
layer layout, and where they differ from the kind's defaults its aux layers and own lm_head's
rows) and `model.safetensors` (trainable tensors only; the embedding, and unless the drafter has
its own, the lm_head belong to the policy), and `SHA256SUMS` over both (checked before a load:
a file damaged on disk is named, never loaded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from fastdraft.drafter.base import Drafter, build_drafter
from fastdraft.drafter.layout import LAYOUT_KEY, saved_layout
from fastdraft.errors import FastdraftError
from fastdraft.models import CausalLM, ModelConfig, load_named_tensors
from fastdraft.utils.atomic import atomic_dir
from fastdraft.utils.file_digest import check_sums, write_sums
from fastdraft.utils.tensor_file import save_tensors

CONFIG_FILE = "drafter_config.json"
WEIGHTS_FILE = "model.safetensors"
# What must agree between a drafter and the policy it serves.
_MATCH_FIELDS = ("model_type", "hidden_size", "vocab_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")


def save_drafter(drafter: Drafter, out_dir: str | Path, extra: dict | None = None,
                 overwrite: bool = False) -> None:
    """Atomic: a killed process never leaves a half-written drafter in place. Replaces only an
    earlier drafter (or anything, with `overwrite`: utils/outputs.py)."""
    with atomic_dir(out_dir, kind="drafter", overwrite=overwrite) as tmp:
        tensors = {n: t.detach().cpu().contiguous() for n, t in drafter.state_dict().items()}
        save_tensors(tensors, str(tmp / WEIGHTS_FILE))
        options = drafter.options
        meta = {"kind": drafter.kind, "policy_config": drafter.config.to_hf_dict(),
                LAYOUT_KEY: drafter.layout.to_dict(), **(extra or {})}
        if options["aux_layers"] is not None:
            meta["aux_layers"] = list(options["aux_layers"])
        if options["head_rows"] is not None:
            meta["head_rows"] = options["head_rows"]
        if drafter.draft_token_ids is not None:
            meta["draft_token_ids"] = drafter.draft_token_ids.tolist()
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=2))
        write_sums(tmp)


def load_drafter(path: str | Path, policy: CausalLM, max_positions: int) -> Drafter:
    """Loads a drafter for `policy`, refusing one trained for a differently shaped policy. The
    layer is built with the checkpoint's own layout: one saved before drafters had their own
    (its layer copied the policy's biases / QK-norm) still runs, though it may not export."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{path / CONFIG_FILE} not found: --drafter takes a directory "
                                "written by `fastdraft drafter warmup` (or save_drafter)")
    check_sums(path)
    meta = read_drafter_config(path)
    _check_trained_for(path, meta, policy.config)
    param = next(policy.parameters())
    drafter = build_drafter(meta["kind"], policy.config, max_positions, **saved_options(meta))
    drafter = drafter.to(device=param.device, dtype=param.dtype).attach(policy)
    named = load_file(str(path / WEIGHTS_FILE), device=str(param.device))
    load_named_tensors(drafter, named.items())
    missing = {n for n, _ in drafter.named_parameters()} - set(named)
    if missing:
        raise FastdraftError(f"drafter {path} lacks weights {sorted(missing)[:3]}")
    if meta.get("draft_token_ids") is not None:
        drafter.draft_token_ids = torch.tensor(meta["draft_token_ids"], dtype=torch.long)
    check_head_vocab(drafter, str(path))
    return drafter.eval()


def read_drafter_config(path: str | Path) -> dict:
    """drafter_config.json of the drafter at `path`, or one line saying what is wrong with it."""
    file = Path(path) / CONFIG_FILE
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FastdraftError(f"{file} is not JSON ({err}): the drafter directory is damaged; "
                             "train or import the drafter again") from None
    missing = [k for k in ("kind", "policy_config") if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise FastdraftError(f"{file} lacks {', '.join(missing)}: not a drafter fastdraft wrote "
                             "(`fastdraft drafter warmup` or `drafter import` write one)")
    return meta


def check_drafter_fits(path: str | Path, policy_config: ModelConfig, setting: str) -> None:
    """What load_drafter refuses, told from the files alone (no weights loaded): a drafter
    trained for another policy, of an unknown kind, or whose weights (the header of
    model.safetensors) lack a tensor, differ in shape or are not floats."""
    from fastdraft.drafter.base import DRAFTERS
    from fastdraft.utils.tensor_file import check_tensor_headers, tensor_headers
    path = Path(path)
    meta = read_drafter_config(path)
    _check_trained_for(path, meta, policy_config)
    if meta["kind"] not in DRAFTERS:
        raise FastdraftError(f"{setting} {path}: unknown drafter kind {meta['kind']!r} in "
                             f"{CONFIG_FILE} (known: {sorted(DRAFTERS)})")
    with torch.device("meta"):
        drafter = build_drafter(meta["kind"], policy_config, 1, **saved_options(meta))
    expected = {n: tuple(t.shape) for n, t in drafter.named_parameters()}
    if not (path / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{setting} {path}: no {WEIGHTS_FILE} there (the drafter's "
                                "weights): the directory is incomplete; train or import it again")
    check_tensor_headers(tensor_headers(path / WEIGHTS_FILE), expected,
                         f"{setting} {path / WEIGHTS_FILE}")


def _check_trained_for(path: Path, meta: dict, policy: ModelConfig) -> None:
    trained_for = ModelConfig.from_hf_dict(meta["policy_config"])
    mismatches = [f"{f}: drafter {getattr(trained_for, f)} vs policy {getattr(policy, f)}"
                  for f in _MATCH_FIELDS if getattr(trained_for, f) != getattr(policy, f)]
    if mismatches:
        raise FastdraftError(f"drafter {path} does not match the policy ({'; '.join(mismatches)}): "
                             "train a drafter for this policy with `fastdraft drafter warmup`")


def saved_options(meta: dict) -> dict:
    """build_drafter's options as drafter_config.json records them (Drafter.options)."""
    aux = meta.get("aux_layers")
    return {"layout": saved_layout(meta), "aux_layers": None if aux is None else tuple(aux),
            "head_rows": meta.get("head_rows")}


def check_head_vocab(drafter: Drafter, where: str) -> None:
    """An own lm_head over fewer rows than the vocabulary needs the draft vocabulary that says
    which token each row scores, one id a row."""
    if drafter.head is None:
        return
    rows, ids = drafter.head.out_features, drafter.draft_token_ids
    if ids is None and rows != drafter.config.vocab_size:
        raise FastdraftError(f"{where}: the drafter's lm_head scores {rows} draft tokens but no "
                             "draft vocabulary says which (d2t / draft_token_ids missing)")
    if ids is not None and len(ids) != rows:
        raise FastdraftError(f"{where}: the draft vocabulary has {len(ids)} tokens but the "
                             f"drafter's lm_head {rows} rows")


def trainable_named_tensors(drafter: Drafter) -> list[tuple[str, torch.Tensor]]:
    """What a published drafter version carries (embedding/lm_head are the policy's)."""
    return [(n, p.detach()) for n, p in drafter.named_parameters()]
