"""The actor as the RL loop sees it: the policy being trained over `actor.num_ranks` ranks (rank 0
in this process and the others in processes of their own, or every rank in a hybrid worker:
workers/ranks.py), fp32 master weights sharded with FSDP2 (actor_rank.py), computing in
`actor.compute_dtype`.

One `update` is one optimizer step over a whole rollout batch: the batch is cut into micro-
batches bounded by a token budget, spread over the ranks (each micro-batch contributes its
share of the batch loss, so neither the budget nor the number of ranks changes the gradient),
forward and backward on every rank, then the lossless gate on rank 0 with every rank's
logprobs, then clipping by the global norm and the step, or nothing when the gate refuses.
Weights leave the actor one full parameter at a time (`full_parameters`), cast by the engine to
its own dtype as they land: never a second copy of the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from fastdraft.actor.rank import ActorSpec
from fastdraft.actor.samples import RowHidden
from fastdraft.actor.sharding import free_port
from fastdraft.algo.objective import Algorithm
from fastdraft.algo.sequences import SequenceBatch, split_across_ranks
from fastdraft.algo.token_stats import TokenStats
from fastdraft.checkpoint.snapshot import WeightSource
from fastdraft.workers.ranks import ActorRanks, LocalRanks


@dataclass(frozen=True, slots=True)
class UpdateResult:
    applied: bool                  # False: a non-finite or zero gradient skipped the step
    metrics: dict[str, float]
    hidden: dict[int, RowHidden] = field(default_factory=dict)   # batch row -> hidden states


class Actor:
    def __init__(self, spec: ActorSpec,
                 ranks: Callable[[ActorSpec], ActorRanks] = LocalRanks) -> None:
        """ranks(spec): the transport that starts the ranks and carries calls to them
        (workers/ranks.py); several ranks rendezvous at spec.address:spec.port (a free port
        of this machine unless the spec names one)."""
        self.world = spec.actor.num_ranks
        if self.world > 1 and not spec.port:
            spec = replace(spec, port=free_port())
        self.spec = spec
        # The loss normaliser of a batch (the ranks' objectives divide by it).
        self.algorithm = Algorithm(spec.algorithm, spec.temperature,
                                   max_tokens=spec.max_new_tokens)
        self.ranks = ranks(spec)

    @property
    def step(self) -> int:
        """Optimizer steps taken (what the LR schedule counts)."""
        return self.ranks.call("steps_taken")[0]

    # ---------------------------------------------------------------------------- an update
    def update(self, batch: SequenceBatch,
               before_step: Callable[[TokenStats], None] | None = None,
               hidden_layers: tuple[int, ...] | None = None) -> UpdateResult:
        """One optimizer step over the batch. before_step receives the actor's TokenStats of
        the whole batch ([B, L - 1] each: logprobs, and the sampling law's entropy and variance,
        from the very forwards the gradient comes from, every rank's) before any weight moves:
        the lossless gate checks them there; an exception from it discards the gradients on
        every rank and propagates. hidden_layers (not None): the result also holds every row's
        hidden states from those forwards (final, and the inputs of these layers)."""
        plan = split_across_ranks(batch, self.spec.actor.micro_batch_tokens, self.world,
                                  self.spec.actor.pack_sequences)
        parts = [[None if rows is None else batch.rows(rows) for rows in micro]
                 for micro in plan]
        total = self.algorithm.normaliser(batch)
        answers = self.ranks.call("accumulate", [(part, total, hidden_layers) for part in parts])
        seen = torch.zeros(len(TokenStats._fields), *batch.mask.shape)
        metrics: dict[str, float] = {}
        hidden: dict[int, RowHidden] = {}
        for micro, (results, rank_metrics, rank_hidden) in zip(plan, answers):
            real = [r for r in micro if r is not None]
            for rows, stats in zip(real, results):
                seen[:, rows, : stats.logprob.shape[1]] = torch.stack(stats)
            for rows, states in zip(real, rank_hidden):
                hidden.update(zip(rows.tolist(), states))
            for key, value in rank_metrics.items():
                metrics[key] = metrics.get(key, 0.0) + value
        if before_step is not None:
            try:
                before_step(TokenStats(*seen.unbind(0)))
            except BaseException:
                self.ranks.call("discard")
                raise
        step_metrics = self.ranks.call("apply")[0]
        return UpdateResult(step_metrics["actor/skipped"] == 0.0, {**metrics, **step_metrics},
                            hidden)

    @torch.no_grad()
    def logprobs(self, batch: SequenceBatch) -> torch.Tensor:
        """The actor's logprobs of every token of the batch [B, L - 1] (no gradient)."""
        out = torch.zeros(batch.mask.shape)
        for rows, lp in self._forward_on_ranks("logprobs", batch):
            out[rows, : lp.shape[1]] = lp
        return out

    @torch.no_grad()
    def hidden_states(self, batch: SequenceBatch, layers: tuple[int, ...]
                      ) -> dict[int, RowHidden]:
        """Every row's hidden states (final, and the inputs of `layers`), no gradient."""
        out: dict[int, RowHidden] = {}
        for rows, states in self._forward_on_ranks("hidden", batch, layers):
            out.update(zip(rows.tolist(), states))
        return out

    def _forward_on_ranks(self, command: str, batch: SequenceBatch, *args: Any
                          ) -> Iterator[tuple[torch.Tensor, Any]]:
        """The batch's micro-batches spread over the ranks, `ActorRank.<command>(micro,
        *args)` on each (one answer per real micro-batch): (its row indices, its answer)."""
        plan = split_across_ranks(batch, self.spec.actor.micro_batch_tokens, self.world,
                                  self.spec.actor.pack_sequences)
        parts = [[None if rows is None else batch.rows(rows) for rows in micro]
                 for micro in plan]
        answers = self.ranks.call(command, [(part, *args) for part in parts])
        for micro, results in zip(plan, answers):
            yield from zip([r for r in micro if r is not None], results)

    # ------------------------------------------------------------------ weights and state
    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full fp32 tensor) of every parameter, one at a time, in this process
        (what `engine.load_weights` takes; hybrid workers load their engines themselves).
        Consume it to the end: every rank takes part."""
        return self.ranks.full_parameters()

    def full_state(self) -> AbstractContextManager[tuple[WeightSource, dict]]:
        """(the model's full weights, gathered one at a time as the block iterates
        `named_parameters()` once; the training state: full AdamW state keyed by name, LR
        schedule, loss scale) for a checkpoint (TrainState takes the first as its model)."""
        return self.ranks.full_state()

    def load_training_state(self, state: dict) -> None:
        """Restores optimizer, LR schedule and loss scale from rank 0's copy of a checkpoint."""
        self.ranks.call("load_training_state", [(state,)] + [({},)] * (self.world - 1))

    def load_shards(self, ckpt: Path, schedule: dict) -> None:
        """Every rank reads its part of sharded checkpoint `ckpt`, whatever number of ranks
        wrote it (checkpoint/sharded.py); `schedule`: its LR schedule and loss scale."""
        self.ranks.call("load_shards", (ckpt, schedule))

    def lost_rank(self, grace_s: float = 0.0) -> str | None:
        """A rank that died, as words (what a failed collective really means); None when
        every rank lives (watched for grace_s)."""
        return self.ranks.lost(grace_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Ends the ranks this actor started (asked, then killed after timeout_s)."""
        if getattr(self, "ranks", None) is not None:
            self.ranks.close(timeout_s)
