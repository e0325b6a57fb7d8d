"""The unit costs that decide whether length-aware budgets pay: in one policy forward over B rows
at a context, what a row-step costs and what one more drafted token in a row costs.

Timed in place with the engine's own ModelRunner (random tokens over whatever the cache holds:
the cost does not depend on the values), round-robin: a plain decode of B rows, a verify of B
rows of `width` tree nodes each, and a split forward (`verify_split`) of `tree_rows` tree rows
beside B - tree_rows plain rows. From them: row_step = decode / B, drafted_token = (verify -
decode) / (B * width), and `breakeven_accept_length` = 1 + width * drafted_token / row_step:
the accept length below which decoding a row plainly is cheaper per token than verifying its
tree (drafting not counted, so budgets need at least this much less). A short request is worth
leaving plain only where the rollout's accept length is below it (spec/budget.py).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from fastdraft.bench.common import interleaved_medians
from fastdraft.engine.model_runner import ModelRunner
from fastdraft.engine.spec.batch import DraftBatch
from fastdraft.engine.spec.tree import ROOT, DraftTree
from fastdraft.errors import FastdraftError


def _trees(num_rows: int, width: int, vocab: int, seed: int = 0) -> list[DraftTree]:
    rng = random.Random(seed)
    return [DraftTree(torch.tensor([rng.randrange(vocab) for _ in range(width)]),
                      torch.tensor([ROOT] + [rng.randrange(-1, i) for i in range(1, width)]),
                      None, None) for _ in range(num_rows)]


@torch.inference_mode()
def row_costs(runner: ModelRunner, batch: int, context: int, width: int, tree_rows: int,
              repeats: int = 10) -> dict[str, Any]:
    """Milliseconds of the three forwards and the unit costs (module doc). context: cells each
    row has before the step (<= the runner's cache length - width - 2)."""
    if not 0 < tree_rows < batch:
        raise FastdraftError(f"tree_rows must be in (0, batch), got {tree_rows} of {batch}")
    device, vocab = runner.device, runner.model.config.vocab_size
    root_ids = torch.randint(vocab, (batch,), device=device)
    root_pos = torch.full((batch,), context, device=device)
    ctx = context + 2 + width
    full = DraftBatch.from_trees(_trees(batch, width, vocab), device)
    split = DraftBatch.from_trees(_trees(tree_rows, width, vocab), device)

    def timed(fn):
        def run() -> None:
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return run
    medians = interleaved_medians({
        "decode": timed(lambda: runner.decode(root_ids, root_pos, context + 1)),
        "verify": timed(lambda: runner.verify(root_ids, root_pos, full, ctx)),
        "split": timed(lambda: runner.verify_split(root_ids, root_pos, split, ctx,
                                                   context + 1))}, repeats)
    ms = {name: seconds * 1e3 for name, (seconds, _) in medians.items()}
    row_step = ms["decode"] / batch
    drafted_token = max(ms["verify"] - ms["decode"], 0.0) / (batch * width)
    return {"batch": batch, "context": context, "width": width, "tree_rows": tree_rows,
            "decode_ms": ms["decode"], "verify_ms": ms["verify"], "split_ms": ms["split"],
            "row_step_ms": row_step, "drafted_token_ms": drafted_token,
            "split_vs_verify": ms["split"] / ms["verify"],
            "breakeven_accept_length": 1 + width * drafted_token / row_step}


def summary_line(costs: dict[str, Any]) -> str:
    return (f"{costs['batch']} rows at {costs['context']} cells: decode {costs['decode_ms']:.1f} "
            f"ms, verify of {costs['width']} nodes {costs['verify_ms']:.1f} ms, split "
            f"({costs['tree_rows']} tree rows) {costs['split_ms']:.1f} ms; row-step "
            f"{costs['row_step_ms']:.3f} ms, drafted token {costs['drafted_token_ms']:.3f} ms: "
            f"plain beats a tree below accept length {costs['breakeven_accept_length']:.2f}")
