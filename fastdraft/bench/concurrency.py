"""How many more requests a paged KV cache holds than static slots in the same bytes, for a
recipe's shapes and a published answer-length trace (`fastdraft bench kv --trace`).

A static slot reserves the recipe's whole sequence (the engine's cache_len: max_seq_len + the
draft tree's cells) for every request. A paged request holds its prompt's full blocks shared
with its GRPO group (one copy a group), then its own blocks for the prompt's partial block and
its answer. The figure is conservative: every request is counted at its *final* length, as if
none finished before the others grew (a rollout's requests finish along the way and free their
blocks, so a real pool holds more). Bytes per cell are the same on both sides, so the ratio is
in cells and does not depend on the model.

The trace gives a mean answer length under its own answer cap; it is scaled to the recipe's
answer budget (the same share of the budget), since a run's answers fill the cap it is given."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fastdraft.config import RunConfig
from fastdraft.engine.envelope import Envelope
from fastdraft.errors import FastdraftError
from fastdraft.run.inputs import rollout_seq_len

DEFAULT_TRACE = Path(__file__).with_name("traces") / "verl-issue-7412-step34.json"


def concurrency(cfg: RunConfig, trace_path: Path, block_size: int) -> dict[str, Any]:
    """Requests that fit in the same KV cells, paged over static slots, for cfg's shapes and
    the trace's mean answer (scaled to cfg.rollout.max_new_tokens) and prompt length."""
    trace = json.loads(Path(trace_path).read_text())
    for key in ("response_length", "response_cap", "prompt_length", "source"):
        if key not in trace:
            raise FastdraftError(f"{trace_path}: a length trace needs {key!r} (see "
                                 f"{DEFAULT_TRACE.name})")
    budget = cfg.rollout.max_new_tokens
    answer = trace["response_length"]["mean"] / trace["response_cap"] * budget
    prompt = int(trace["prompt_length"])
    static_cells = Envelope.for_spec(rollout_seq_len(cfg), cfg.rollout.spec).cache_len
    shared_blocks = prompt // block_size                 # full prompt blocks, one copy a group
    own_blocks = math.ceil((prompt % block_size + answer) / block_size)
    paged_cells = (shared_blocks / cfg.rollout.group_size + own_blocks) * block_size
    return {"trace": trace["source"], "answer_cells": answer, "prompt_cells": prompt,
            "static_cells_per_request": static_cells,
            "paged_cells_per_request": paged_cells,
            "concurrency_ratio": static_cells / paged_cells}
