"""The inverse of export: an exported directory back into a fastdraft drafter. It proves an
export holds the trained drafter and nothing else (the round-trip tests run the reloaded drafter
against the original), and lets fastdraft run a drafter it only has in engine format."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from fastdraft.drafter import Drafter, build_drafter
from fastdraft.errors import FastdraftError
from fastdraft.export.formats import CONFIG_FILE, EAGLE3_ARCHITECTURE, WEIGHTS_FILE
from fastdraft.export.names import from_engine_names
from fastdraft.export.vocab import target_ids_from_offsets
from fastdraft.models import CausalLM, load_named_tensors
from fastdraft.utils.file_digest import check_sums

# bfloat16 keeps 8 significant bits: an lm_head exported from this policy is within this of it.
_BF16_RTOL = 2.0 ** -7


def load_exported_drafter(export_dir: str | Path, policy: CausalLM, max_positions: int
                          ) -> Drafter:
    """Builds a drafter for `policy` from an exported directory (any variant). Raises if the
    export holds something a fastdraft drafter cannot represent (a non-zero fc.bias) or an
    lm_head that is not `policy`'s."""
    export_dir = Path(export_dir)
    check_sums(export_dir)
    config = json.loads((export_dir / CONFIG_FILE).read_text())
    architecture = config["architectures"][0]
    kind = "eagle3" if architecture == EAGLE3_ARCHITECTURE else "eagle1"
    tensors = load_file(str(export_dir / WEIGHTS_FILE))
    fc_bias = tensors.pop("fc.bias", None)
    if fc_bias is not None and bool(fc_bias.any()):
        raise FastdraftError(f"{export_dir}: fc.bias is non-zero, but fastdraft's fc has no bias")
    lm_head = tensors.pop("lm_head.weight", None)
    d2t, _ = tensors.pop("d2t", None), tensors.pop("t2d", None)
    draft_ids = None if d2t is None else target_ids_from_offsets(d2t)
    named = from_engine_names(kind, architecture, tensors)

    param = next(policy.parameters())
    drafter = build_drafter(kind, policy.config, max_positions)
    drafter = drafter.to(device=param.device, dtype=param.dtype).attach(policy)
    load_named_tensors(drafter, ((n, t.to(param.dtype)) for n, t in named.items()))
    missing = sorted({n for n, _ in drafter.named_parameters()} - set(named))
    if missing:
        raise FastdraftError(f"{export_dir} lacks drafter weights {missing[:3]}")
    if lm_head is not None:
        _check_lm_head_is_policys(lm_head, policy, draft_ids, export_dir)
    drafter.draft_token_ids = draft_ids
    return drafter.eval()


def _check_lm_head_is_policys(lm_head: torch.Tensor, policy: CausalLM,
                              draft_ids: torch.Tensor | None, export_dir: Path) -> None:
    """fastdraft drafts with the policy's own lm_head, so the exported one must be its rows."""
    rows = policy.lm_head.weight.detach().cpu().float()
    rows = rows if draft_ids is None else rows[draft_ids]
    if rows.shape != lm_head.shape or not torch.allclose(
            lm_head.float(), rows, rtol=_BF16_RTOL, atol=1e-6):
        raise FastdraftError(f"{export_dir}: lm_head.weight is not this policy's lm_head (over the "
                             "draft vocabulary); the drafter was exported for another policy")
