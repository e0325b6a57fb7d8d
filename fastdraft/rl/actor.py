"""The actor as the RL loop sees it: the policy being trained over `actor.num_ranks` ranks (rank 0
in this process, the others in processes of their own, actor_peers.py), fp32 master weights
sharded with FSDP2 (actor_rank.py), computing in `actor.compute_dtype`.

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
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fastdraft.models import CausalLM
from fastdraft.rl.actor_peers import ActorPeers
from fastdraft.rl.actor_rank import ActorRank, ActorSpec
from fastdraft.rl.actor_samples import RowHidden
from fastdraft.rl.sequences import SequenceBatch, split_across_ranks
from fastdraft.rl.sharding import Gathered, free_port, leave_ranks
from fastdraft.rl.token_stats import TokenStats


@dataclass(frozen=True, slots=True)
class UpdateResult:
    applied: bool                  # False: a non-finite or zero gradient skipped the step
    metrics: dict[str, float]
    hidden: dict[int, RowHidden] = field(default_factory=dict)   # batch row -> hidden states


class Actor:
    def __init__(self, spec: ActorSpec, peers: Callable[..., Any] = ActorPeers) -> None:
        """peers: how ranks 1..N-1 run: processes of this one (ActorPeers) or Ray actors
        (cluster/actor_group.RayActorPeers); same commands, same answers."""
        self.world = spec.actor.num_ranks
        if self.world > 1:
            spec = replace(spec, port=free_port())
        self.spec = spec
        # The followers start first: rank 0's process-group rendezvous waits for them.
        self.peers = peers(spec) if self.world > 1 else None
        try:
            self.rank0 = ActorRank(spec, 0)
            self._gather("start-up")
        except BaseException:
            self.close()
            raise

    @property
    def step(self) -> int:
        """Optimizer steps taken (what the LR schedule counts)."""
        return self.rank0.optimizer_steps

    @property
    def model(self) -> CausalLM:
        """Rank 0's (shard of the) policy."""
        return self.rank0.model

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
        plan = split_across_ranks(batch, self.spec.actor.micro_batch_tokens, self.world)
        parts = [[None if rows is None else batch.rows(rows) for rows in micro]
                 for micro in plan]
        total = self.rank0.algorithm.normaliser(batch)
        self._send("accumulate", [(part, total, hidden_layers) for part in parts[1:]])
        answers = [self.rank0.accumulate(parts[0], total, hidden_layers),
                   *self._gather("accumulate")]
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
                self._everywhere("discard")
                raise
        step_metrics = self._everywhere("apply")
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
        plan = split_across_ranks(batch, self.spec.actor.micro_batch_tokens, self.world)
        parts = [[None if rows is None else batch.rows(rows) for rows in micro]
                 for micro in plan]
        self._send(command, [(part, *args) for part in parts[1:]])
        answers = [getattr(self.rank0, command)(parts[0], *args), *self._gather(command)]
        for micro, results in zip(plan, answers):
            yield from zip([r for r in micro if r is not None], results)

    # ------------------------------------------------------------------ weights and state
    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full fp32 tensor) of every parameter, one at a time (what
        `engine.load_weights` takes). Consume it to the end: every rank takes part."""
        self._send("drain_parameters")
        gathered = self.rank0.gathered()
        try:
            yield from gathered.named_parameters()
        finally:
            gathered.finish()   # a consumer that stopped early: the followers still gather
            self._gather("the weight gather")

    @contextmanager
    def full_state(self) -> Iterator[tuple[Gathered, dict]]:
        """(the model's full weights, gathered one at a time as the block iterates
        `named_parameters()` once; the training state: full AdamW state keyed by name, LR
        schedule, loss scale) for a checkpoint (TrainState takes the first as its model)."""
        self._send("checkpoint_gather")
        gathered = self.rank0.gathered()
        try:
            yield gathered, self.rank0.training_state()
        finally:
            gathered.finish()
            self._gather("the checkpoint gather")

    def load_training_state(self, state: dict) -> None:
        """Restores optimizer, LR schedule and loss scale from rank 0's copy of a checkpoint."""
        self._send("load_training_state", ({},))
        self.rank0.load_training_state(state)
        self._gather("the optimizer restore")

    def lost_rank(self, grace_s: float = 0.0) -> str | None:
        """A follower rank that died, as words (what a failed collective really means);
        None when every rank lives (watched for grace_s)."""
        return self.peers.lost(grace_s) if self.peers is not None else None

    def close(self, timeout_s: float = 30.0) -> None:
        """Ends the follower ranks (asked, then killed after timeout_s)."""
        if getattr(self, "peers", None) is not None:
            self.peers.close(timeout_s)
            self.peers = None
            leave_ranks()

    # -------------------------------------------------------------------------- the ranks
    def _send(self, name: str, args: list[tuple] | tuple = ()) -> None:
        if self.peers is not None:
            self.peers.send(name, args)

    def _gather(self, what: str) -> list:
        return self.peers.gather(what) if self.peers is not None else []

    def _everywhere(self, name: str) -> dict:
        """Runs a no-argument method on every rank; returns rank 0's answer."""
        self._send(name)
        mine = getattr(self.rank0, name)()
        self._gather(name)
        return mine
