"""The end of a run's drafter: the one saved in RUN_DIR/drafter exported for SGLang / vLLM, with
a report that says loudly which happened. The exported drafter is what users keep from a run, so a
refused export must not hide in the log: the report gives the reason and the command to retry."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from fastdraft.export import export_drafter
from fastdraft.export.formats import CONFIG_FILE, export_dirs, layout_engines

_ENGINE_NAMES = {"sglang": "SGLang", "vllm": "vLLM"}
_LAYOUT_NOTES = {"speculators": " (speculators layout)"}
_RULE = "=" * 72


@dataclass(frozen=True, slots=True)
class DrafterExport:
    run_dir: Path
    drafter_dir: Path
    # Each directory written, with the engines that load it; empty when nothing was exported.
    written: dict[Path, tuple[str, ...]] = field(default_factory=dict)
    reason: str = ""  # why nothing was exported

    @property
    def exported(self) -> bool:
        return bool(self.written)

    def report(self) -> str:
        if self.exported:
            lines = ["DRAFTER EXPORTED (checked against the engines' loading rules):"]
            lines += [f"  {' and '.join(_ENGINE_NAMES[e] for e in engines)}"
                      f"{_LAYOUT_NOTES.get(path.name, '')}: {path}"
                      for path, engines in self.written.items()]
            lines.append(f"  (the drafter checkpoint: {self.drafter_dir})")
        else:
            lines = [f"DRAFTER NOT EXPORTED: {self.reason}",
                     f"  the trained drafter is saved in {self.drafter_dir}; retry the export "
                     f"with: fastdraft export --run {self.run_dir}"]
        return "\n".join([_RULE, *lines, _RULE])


def export_run_drafter(run_dir: Path, kind: str, policy_dir: Path | None, *,
                       export: bool) -> DrafterExport:
    """Exports the drafter saved in RUN_DIR/drafter for every engine, when `export`, with the
    policy at `policy_dir` (the newest checkpoint's: an EAGLE-3 export carries the trained
    lm_head). A refusal is reported, not raised: the run itself has finished."""
    drafter_dir = run_dir / "drafter"
    if not export:
        return DrafterExport(run_dir, drafter_dir, reason="drafter.export is false in the recipe")
    if policy_dir is None:
        return DrafterExport(run_dir, drafter_dir, reason=(
            f"no complete checkpoint in {run_dir / 'checkpoints'} to read the trained policy "
            "from (the export must match it)"))
    out = run_dir / "export"
    try:
        written = export_drafter(drafter_dir, policy_dir, out, "all")
    except (ValueError, FileNotFoundError, OSError) as err:
        return DrafterExport(run_dir, drafter_dir, reason=str(err))
    layouts = export_dirs(out, kind, "all")
    return DrafterExport(run_dir, drafter_dir, {
        path: layout_engines(kind, layouts[path], "eagle_config" not in json.loads(
            (path / CONFIG_FILE).read_text())) for path in written})
