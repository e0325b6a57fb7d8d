"""One rank of the actor: its shard of the policy (fp32 masters, FSDP2; or the whole policy when
one rank computes in fp32), the reference model when a KL term needs one, AdamW, the LR schedule
over optimizer steps, the loss scale, and the micro-steps of an update.

An update is split in two calls so that the lossless gate can run between them on rank 0, with
every rank's logprobs in hand and no weight touched yet: `accumulate` (forward + backward of
this rank's micro-batches, gradients reduced across ranks) and then `apply` (clip by the global
norm, one optimizer step) or `discard`. Every rank runs the same number of forward/backward
passes (the planner pads with empty micro-batches): FSDP's collectives pair them up.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from fastdraft.actor.loss_scale import LossScaler
from fastdraft.actor.samples import RowHidden, row_hidden
from fastdraft.actor.sharding import (
    DTYPES,
    Gathered,
    UnitGathered,
    checkpoint_layers,
    init_ranks,
    load_plain,
    load_sharded,
    rank_device,
)
from fastdraft.algo.answer_scores import AnswerScores, ScoreSpec
from fastdraft.algo.objective import Algorithm
from fastdraft.algo.sequences import SequenceBatch, empty_batch
from fastdraft.algo.token_stats import TokenStats
from fastdraft.checkpoint.sharded import load_shards, save_shards
from fastdraft.config.sections import ActorConfig, AlgorithmConfig
from fastdraft.models import CausalLM
from fastdraft.utils.schedule import warmup_cosine_lr


@dataclass(frozen=True, kw_only=True, slots=True)
class ActorSpec:
    """Everything a rank builds itself from (picklable: it travels to the follower ranks)."""

    policy_dir: Path              # the masters to start from (a resumed run: its checkpoint)
    reference_dir: Path           # the initial policy: the KL term's reference
    actor: ActorConfig
    algorithm: AlgorithmConfig
    temperature: float
    top_p: float = 1.0            # the rollout's filter: the gate's law statistic applies it
    top_k: int = -1
    max_new_tokens: int
    max_positions: int
    device: str                   # rank 0's device (model.device); rank r takes the r-th next
    num_steps: int                # RL steps of the run
    port: int = 0                 # the process group's rendezvous (several ranks) ...
    address: str = "127.0.0.1"    # ... on rank 0's node (with several: the IP Ray gives it)

    @property
    def total_optimizer_steps(self) -> int:
        return self.num_steps * self.actor.updates_per_step

    @property
    def sharded(self) -> bool:
        """One rank computing in fp32 runs the plain model; anything else is FSDP2."""
        return self.actor.num_ranks > 1 or self.actor.compute_dtype != "float32"

    @property
    def scores(self) -> ScoreSpec:
        """How a forward scores the answer tokens (packed, chunked logits; the gate's filter)."""
        return ScoreSpec(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                         packed=self.actor.pack_sequences,
                         chunk_tokens=self.actor.logits_chunk_tokens)



class ActorRank:
    def __init__(self, spec: ActorSpec, rank: int = 0, device: str | None = None) -> None:
        self.spec, self.rank, self.world = spec, rank, spec.actor.num_ranks
        # device: a rank that sees only its own GPU (a Ray actor's cuda:0) names it
        self.device = torch.device(device) if device else rank_device(spec.device, rank)
        cfg = spec.actor
        compute = DTYPES[cfg.compute_dtype]
        if spec.sharded:
            init_ranks(rank, self.world, spec.address, spec.port, self.device)
            self.model = load_sharded(spec.policy_dir, self.device, compute, spec.max_positions)
        else:
            self.model = load_plain(spec.policy_dir, self.device, spec.max_positions)
        if cfg.activation_checkpointing:
            checkpoint_layers(self.model)
        self.model.train()
        self.reference: CausalLM | None = None
        if spec.algorithm.kl_coef > 0:   # KL to the frozen initial policy, sharded alike
            # Frozen: it needs no fp32 copy, only the compute dtype its forward runs in.
            self.reference = (load_sharded(spec.reference_dir, self.device, compute,
                                           spec.max_positions, storage_dtype=compute)
                              if spec.sharded else
                              load_plain(spec.reference_dir, self.device, spec.max_positions))
            self.reference.eval().requires_grad_(False)
        self.algorithm = Algorithm(spec.algorithm, spec.temperature,
                                   max_tokens=spec.max_new_tokens)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=cfg.betas,
                                           weight_decay=cfg.weight_decay)
        total = spec.total_optimizer_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: (
            warmup_cosine_lr(step, lr=1.0, warmup_steps=cfg.warmup_steps, total_steps=total,
                             min_ratio=1.0)))
        self.scaler = LossScaler(compute, self.device)

    @property
    def optimizer_steps(self) -> int:
        return int(self.scheduler.last_epoch)

    def steps_taken(self) -> int:
        """optimizer_steps, as a call the rank transports carry."""
        return self.optimizer_steps

    # ---------------------------------------------------------------------------- an update
    def accumulate(self, micro: list[SequenceBatch | None], total: float,
                   hidden_layers: tuple[int, ...] | None = None
                   ) -> tuple[list[TokenStats], dict[str, float], list[list[RowHidden]]]:
        """Forward and backward of this rank's micro-batches (None: an empty one, to pair up
        with a peer's); `total` is the whole batch's loss normaliser, so each micro-batch adds
        its share of the *batch* loss whatever rank it landed on. Gradients accumulate.
        hidden_layers (not None): each real micro-batch's rows' hidden states too, final and
        the inputs of these layers (the online drafter's samples: actor/samples.py)."""
        objective = self.algorithm.objective(None, self._reference_logprobs(), total=total)
        results, metrics, hidden = [], {}, []
        for mb in micro:
            real = mb is not None
            mb = (mb if real else empty_batch()).to(self.device)
            scores = AnswerScores(mb, self.spec.scores)
            logprobs, stats, states = scores.forward(self.model, hidden_layers or (),
                                                     stats=real)
            if real and hidden_layers is not None:
                hidden.append(row_hidden(mb, states, scores.row_states))
            del states
            loss, mb_metrics = objective(logprobs, mb)
            # FSDP averages gradients over ranks; the batch loss is the ranks' sum.
            loss = loss * self.world + 0.0 * logprobs.sum()   # empty: still a backward
            self.scaler.scale_loss(loss).backward()
            if real:   # what the lossless gate reads, from the forward the gradient uses
                results.append(stats)
                for key, value in mb_metrics.items():
                    metrics[key] = metrics.get(key, 0.0) + value
        return results, metrics, hidden

    def apply(self) -> dict[str, float]:
        """Clips by the global gradient norm and takes one optimizer step (all ranks skip
        together when the norm is not finite, or zero: Adam would still move by momentum)."""
        lr = self.optimizer.param_groups[0]["lr"]
        self.scaler.unscale(self.optimizer)
        clip = self.spec.actor.grad_clip   # None: not clipped (inf: the norm is still measured)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                              float("inf") if clip is None else clip)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        scale = self.scaler.scale
        applied = self.scaler.step(self.optimizer, norm)
        self.optimizer.zero_grad(set_to_none=True)
        if applied:   # the schedule counts the optimizer steps taken
            self.scheduler.step()
        return {"actor/grad_norm": norm, "actor/lr": lr,
                "actor/skipped": 0.0 if applied else 1.0,
                **({"actor/loss_scale": scale} if self.scaler.enabled else {})}

    def discard(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _reference_logprobs(self):
        """The frozen reference's logprobs of a micro-batch (the KL term's), or None."""
        if self.reference is None:
            return None
        return lambda mb: AnswerScores(mb, self.spec.scores).forward(self.reference)[0]

    @torch.no_grad()
    def hidden(self, micro: list[SequenceBatch | None], layers: tuple[int, ...]
               ) -> list[list[RowHidden]]:
        """Each real micro-batch's rows' hidden states (final, and the inputs of `layers`),
        no gradient: the online drafter's samples of rows the update does not train on."""
        out = []
        for mb in micro:
            scores = AnswerScores((mb if mb is not None else empty_batch()).to(self.device),
                                  self.spec.scores)
            _, states = self.model(scores.input_ids, scores.positions, attn=scores.attn,
                                   aux_layers=layers, score=lambda final, weight: None)
            if mb is not None:
                out.append(row_hidden(mb, states, scores.row_states))
        self._reshard()
        return out

    def _reshard(self) -> None:
        """A forward without backward leaves FSDP2's root unsharded (its post-backward would
        reshard it): sharded again, so the next gather sees the same DTensors on every rank
        (else the weight and checkpoint gathers of the ranks fall out of step)."""
        reshard = getattr(self.model, "reshard", None)
        if reshard is not None:
            reshard()

    @torch.no_grad()
    def logprobs(self, micro: list[SequenceBatch | None]) -> list[torch.Tensor]:
        out = []
        for mb in micro:
            scores = AnswerScores((mb if mb is not None else empty_batch()).to(self.device),
                                  self.spec.scores)
            lp = scores.forward(self.model)[0].cpu()
            if mb is not None:
                out.append(lp)
        self._reshard()
        return out

    # ------------------------------------------------------------------ weights and state
    def gathered(self) -> Gathered:
        """The full fp32 parameters for one pass, one at a time; collective when sharded."""
        return Gathered(self.model)

    def gathered_for(self, dtype: torch.dtype) -> Gathered | UnitGathered:
        """The full parameters for a consumer in `dtype` (an engine): one all-gather per FSDP
        unit, in the compute dtype, when that is `dtype` or fp32 (the tensors are then the
        masters cast exactly as the consumer would cast them); else one fp32 parameter at a
        time."""
        if self.spec.sharded and DTYPES[self.spec.actor.compute_dtype] in (dtype, torch.float32):
            return UnitGathered(self.model)
        return self.gathered()

    def drain_parameters(self) -> None:
        """A follower's side of a gather rank 0 consumes: take part, keep nothing."""
        self.gathered().finish()

    def checkpoint_gather(self) -> None:
        """A follower's side of `Actor.full_state`: the same gathers, in the same order."""
        self.training_state()
        self.drain_parameters()

    def host_state(self) -> tuple[dict[str, torch.Tensor], dict] | None:
        """Rank 0: (every full fp32 parameter by name, training_state()) in host memory, for a
        checkpoint written by the driver of hybrid workers; the other ranks take part in the
        same gathers and return None."""
        training = self.training_state()
        gathered = self.gathered()
        params = {name: t.detach().cpu().clone() for name, t in gathered.named_parameters()}
        return (params, training) if self.rank == 0 else None

    def optimizer_state(self) -> dict:
        """The whole AdamW state keyed by parameter name, on rank 0's host (collective);
        {} on the other ranks."""
        return get_optimizer_state_dict(self.model, self.optimizer, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))

    def training_state(self) -> dict:
        """Optimizer (rank 0: full), LR schedule and loss scale: what resume restores."""
        return {"optimizer": self.optimizer_state(), "scheduler": self.scheduler.state_dict(),
                "loss_scale": self.scaler.state_dict()}

    def load_training_state(self, state: dict) -> None:
        """Rank 0 passes the checkpoint's state, the others {}: rank 0's is broadcast."""
        full = state.get("optimizer", {}) if self.rank == 0 else {}
        set_optimizer_state_dict(self.model, self.optimizer, full, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=self.spec.sharded))
        if self.world > 1:   # schedule and scale are plain values: every rank the same
            box = [state.get("scheduler"), state.get("loss_scale")]
            dist.broadcast_object_list(box, src=0)
            state = {"scheduler": box[0], "loss_scale": box[1]}
        self._load_schedule(state)

    def save_shards(self, into: Path | None) -> tuple[Path, dict[str, dict]] | None:
        """Collective: every rank writes its own shard of the masters and AdamW state into
        rank 0's `into` (a sharded checkpoint's temp dir; the others pass None). Rank 0 gets
        (into, every rank's files' COMPLETE entries), the others None."""
        if not _distributed():
            return into, save_shards(self.model, self.optimizer, into)
        box = [into]
        dist.broadcast_object_list(box, src=0)
        entries = save_shards(self.model, self.optimizer, box[0])
        every: list = [None] * self.world
        dist.all_gather_object(every, entries)
        return (box[0], {k: v for e in every for k, v in e.items()}) if self.rank == 0 else None

    def load_shards(self, ckpt: Path, state: dict) -> None:
        """Collective: this rank's part of sharded checkpoint `ckpt` (however many ranks wrote
        it: DCP reshards), then the LR schedule and loss scale in `state` (every rank's the
        same)."""
        load_shards(self.model, self.optimizer, ckpt)
        self._load_schedule(state)

    def schedule_state(self) -> dict:
        """The LR schedule and the loss scale: plain values, the same on every rank."""
        return {"scheduler": self.scheduler.state_dict(), "loss_scale": self.scaler.state_dict()}

    def _load_schedule(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state.get("loss_scale") or {})
        for group in self.optimizer.param_groups:   # the schedule's lr for the next step
            group["lr"] = self.scheduler.get_last_lr()[0]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()
