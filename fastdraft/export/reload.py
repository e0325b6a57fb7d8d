"""The inverse of export: an exported (or any engine) directory back into a fastdraft drafter
for a policy in memory. It proves an export holds the trained drafter and nothing else (the
round-trip tests run the reloaded drafter against the original), and lets fastdraft run a
drafter it only has in an engine's layout (export/imports.py reads and checks it)."""

from __future__ import annotations

from pathlib import Path

from fastdraft.drafter import Drafter
from fastdraft.export.imports import build_engine_drafter, read_engine_drafter
from fastdraft.models import CausalLM


def load_exported_drafter(export_dir: str | Path, policy: CausalLM, max_positions: int
                          ) -> Drafter:
    """Builds a drafter for `policy` from an engine directory (any layout): an lm_head that is
    `policy`'s rows is borrowed, any other becomes the drafter's own."""
    src = read_engine_drafter(export_dir, policy.config)
    drafter = build_engine_drafter(src, policy.config, policy.lm_head.weight, max_positions)
    param = next(policy.parameters())
    drafter = drafter.to(device=param.device, dtype=param.dtype).attach(policy)
    return drafter.eval()
