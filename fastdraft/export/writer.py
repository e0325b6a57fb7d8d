"""export_drafter: a trained fastdraft drafter -> directories SGLang and vLLM load unchanged
(the SpecForge/SGLang and the speculators layouts of an EAGLE-3 drafter; one per engine for
EAGLE-1).

Each directory is staged in a temp dir, checked against the engines' loading rules, and only
then renamed into place: a failed or killed export leaves any previous export untouched."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from fastdraft.drafter.eagle3 import eagle3_aux_layers
from fastdraft.errors import FastdraftError
from fastdraft.export.check import check_export
from fastdraft.export.engine_config import engine_config
from fastdraft.export.formats import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    Layout,
    architecture_for,
    export_dirs,
)
from fastdraft.export.names import to_engine_names
from fastdraft.export.sources import (
    DrafterCheckpoint,
    check_fits_policy,
    read_drafter_checkpoint,
    read_policy_lm_head,
)
from fastdraft.export.speculators import rename_layer, speculators_config
from fastdraft.export.vocab import (
    draft_to_target_offsets,
    reduced_draft_token_ids,
    target_membership,
)
from fastdraft.models import ModelConfig
from fastdraft.utils.atomic import atomic_dir, fsync_tree
from fastdraft.utils.file_digest import write_sums
from fastdraft.utils.outputs import check_output_dir
from fastdraft.utils.tensor_file import save_tensors

# The dtype both engines run drafters in. Writing it (rather than the checkpoint's float32)
# halves the files and makes what the engine runs exactly what was checked.
EXPORT_DTYPE = torch.bfloat16


def export_drafter(drafter_dir: str | Path, policy_dir: str | Path, out_dir: str | Path,
                   fmt: str, *, verifier: str | None = None,
                   speculative_tokens: int = 3, overwrite: bool = False) -> list[Path]:
    """Writes the drafter at `drafter_dir` (saved by save_drafter for the policy at
    `policy_dir`) in the layouts `fmt` names (formats.layouts_for: "sglang", "vllm",
    "speculators", or "all"/"both"); returns the directories written, `out_dir/<layout>`, each
    one an engine's --speculative-draft-model-path. `verifier` (the speculators layout's policy,
    default policy_dir) and `speculative_tokens` go into the speculators config.

    Each directory is replaced as a whole, so it must not exist, be empty, or hold an earlier
    export (anything, with `overwrite`). Every directory is checked with check_export before
    it is published."""
    ckpt = read_drafter_checkpoint(drafter_dir)
    policy = ModelConfig.from_pretrained(policy_dir)
    check_fits_policy(ckpt, policy)
    targets = export_dirs(out_dir, ckpt.kind, fmt)
    for final in targets:   # each replaced as a whole: only an earlier export (outputs.py)
        check_output_dir(final, "export", "the export directory", overwrite=overwrite)
    draft_ids = reduced_draft_token_ids(ckpt.draft_token_ids, policy.vocab_size)
    own_head = "head.weight" in ckpt.tensors
    lm_head = (read_policy_lm_head(policy_dir, policy)
               if ckpt.kind == "eagle3" and not own_head else None)
    # Build every variant before writing any, so a drafter that cannot be exported leaves no trace.
    variants = {final: _build_variant(ckpt, policy, layout, lm_head, draft_ids,
                                      verifier or str(Path(policy_dir).resolve()),
                                      speculative_tokens)
                for final, layout in targets.items()}
    with ExitStack() as staged:  # publishes all on a clean exit, none on an error
        for final, layout in targets.items():
            tmp = staged.enter_context(atomic_dir(final, kind="export", overwrite=overwrite))
            tensors, config = variants[final]
            save_tensors(tensors, str(tmp / WEIGHTS_FILE))
            (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
            write_sums(tmp)   # the engines ignore it; `sha256sum -c SHA256SUMS` checks a copy
            check_export(tmp, layout, ckpt.kind, expected_draft_token_ids=draft_ids,
                         num_layers=policy.num_hidden_layers)
            fsync_tree(tmp)
    return list(targets)


def _build_variant(ckpt: DrafterCheckpoint, policy: ModelConfig, layout: Layout,
                   lm_head: torch.Tensor | None, draft_ids: torch.Tensor | None,
                   verifier: str, speculative_tokens: int
                   ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, config.json) of the directory in `layout`."""
    architecture = architecture_for(ckpt.kind, "sglang" if layout == "speculators" else layout,
                                    policy.model_type)
    tensors = to_engine_names(ckpt.kind, architecture, ckpt.tensors)
    if ckpt.kind == "eagle1" and layout == "sglang":
        # SGLang's fc always has a bias; zeros keep fastdraft's bias-free fc exactly.
        tensors["fc.bias"] = torch.zeros(policy.hidden_size)
    aux = ckpt.aux_layers(policy)
    sglang_aux = None
    if ckpt.kind == "eagle3":
        if "lm_head.weight" not in tensors:   # the drafter borrows the target's: write its rows
            assert lm_head is not None
            tensors["lm_head.weight"] = lm_head if draft_ids is None else lm_head[draft_ids]
        if draft_ids is not None:
            tensors["d2t"] = draft_to_target_offsets(draft_ids)
            tensors["t2d"] = target_membership(draft_ids, policy.vocab_size)
        if aux != eagle3_aux_layers(policy.num_hidden_layers) and layout == "sglang":
            if 0 in aux:
                raise FastdraftError(
                    f"the drafter reads the embedding (aux layers {list(aux)}), which SGLang "
                    "cannot name (its ids count layer outputs): export --format speculators")
            sglang_aux = [i - 1 for i in aux]
    tensors = {n: (t.to(EXPORT_DTYPE) if t.is_floating_point() else t).contiguous()
               for n, t in tensors.items()}
    config = engine_config(policy, architecture, tensors,
                           None if draft_ids is None else len(draft_ids), sglang_aux)
    if layout == "speculators":
        config = speculators_config(config, policy, aux, verifier, speculative_tokens)
        tensors = rename_layer(tensors, to_speculators=True)
    return tensors, config


