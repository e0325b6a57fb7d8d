"""What a resumed run may change. `--resume` continues a run exactly; a recipe or override that
changes what the policy learns (its data, algorithm, optimiser, sampling, precision) would make
the resumed run another experiment under the same name, so it is refused unless
`--resume-force`. Settings that only decide how fast, where or how long it runs, or what it
records, may change freely: speculation is lossless, micro-batching and the number of actor
ranks never change the gradient, rollout placement (cluster.*) never changes a completion, and
the drafter never changes what the policy learns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastdraft.checkpoint.layout import CONFIG_FILE
from fastdraft.errors import FastdraftError

#: Dotted keys (or prefixes ending in ".") a resumed run may change.
FREE_ON_RESUME = (
    "name", "algorithm.num_steps", "algorithm.gate.", "logging.", "checkpoint.", "model.device",
    "model.extend_positions",
    "rollout.max_batch_size", "rollout.spec.", "rollout.tuner.", "rollout.budget.",
    "rollout.graphs", "rollout.compile", "rollout.kv_block_size", "rollout.kv_cache_gb",
    "rollout.prefill_chunk_tokens", "rollout.paged_attention",
    "actor.micro_batch_tokens", "actor.num_ranks", "actor.pack_sequences",
    "actor.logits_chunk_tokens",
    "drafter.", "cluster.",
)


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
            out.update(flat(value, f"{name}."))
        else:
            out[name] = value
    return out


def learning_changes(saved: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """'key: saved -> new' for every setting that differs and may not change on resume."""
    before, after = flat(saved), flat(new)
    changed = []
    for key in sorted(set(before) | set(after)):
        if before.get(key) == after.get(key) or key.startswith(FREE_ON_RESUME):
            continue
        changed.append(f"{key}: {before.get(key, '(unset)')!r} -> {after.get(key, '(unset)')!r}")
    return changed


def check_resume_config(checkpoint: Path, new: dict[str, Any], force: bool) -> None:
    """Raises a FastdraftError listing the learning settings the new config changes (unless
    force)."""
    saved = json.loads((checkpoint / CONFIG_FILE).read_text())
    changed = learning_changes(saved, json.loads(json.dumps(new)))   # as the checkpoint has it
    if changed and not force:
        raise FastdraftError(f"--resume would change what the run learns ({'; '.join(changed)}); "
                             f"resume with the recipe and overrides of {checkpoint.parent.parent}"
                             "/config.yaml, or pass --resume-force to continue under the new ones")
    if changed:
        print("resuming with changed settings (--resume-force): " + "; ".join(changed))


def resume_point(checkpoints: Any, config: dict[str, Any], resume: bool, resume_force: bool,
                 digests: bool = True) -> Path | None:
    """The checkpoint a run in checkpoints.root's run directory starts from (None: a fresh
    start), or a one-line refusal: --resume with no complete checkpoint, a fresh start over a
    run that has one, a resume whose recipe changes what is learned. `checkpoints` a
    CheckpointManager; digests: hash every file (a resume does; a dry run checks sizes)."""
    run_dir = checkpoints.root.parent
    latest = checkpoints.latest(digests=digests) if resume else None
    if resume and latest is None:
        raise FastdraftError(f"--resume: no complete checkpoint in {checkpoints.root}; start a "
                             "new run without --resume")
    if not resume and checkpoints.root.is_dir() and checkpoints.latest():
        raise FastdraftError(f"{run_dir} already holds a run: pass --resume to continue it, or "
                             "choose another --run-dir")
    if latest is not None:   # before anything is written: a refused resume changes nothing
        check_resume_config(latest, config, resume_force)
    return latest
