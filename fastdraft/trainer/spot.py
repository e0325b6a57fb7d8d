"""SpotTrainer: trains the drafter from the DataBuffer in preemptible bursts, on compute the
rollout leaves idle, and publishes versioned, checksummed weights for the engine.

`run(stop)` takes one micro-step at a time (sample a packed batch, one optimizer step) and
checks `stop` between them, so it returns within one micro-step of `stop` being set; the time
from `stop` to return is recorded (`preemption_latencies_s`). It never touches the engine: the
loop publishes at a step boundary. The trainer scores the drafter against its own copy of the
policy's embedding and lm_head (`sync_policy`, at each step boundary), never the actor's live
tensors, so an optimizer step of the actor cannot race with it.

Device: the drafter, its optimizer and the policy head live on `SpotConfig.device`; the
DataBuffer stays in host memory and each packed micro-batch is moved to the device as it is
trained on. What leaves the trainer (published tensors, its state) is on the host.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from fastdraft.databuffer import DataBuffer, PackedBatch
from fastdraft.drafter.acceptance import AcceptEstimate, expected_accept
from fastdraft.drafter.base import Drafter
from fastdraft.drafter.checkpoint import trainable_named_tensors
from fastdraft.drafter.losses import DEFAULT_NUM_STEPS
from fastdraft.errors import FastdraftError
from fastdraft.trainer.losses import DraftBatch, compute_drafter_loss
from fastdraft.utils.digest import tensor_digest
from fastdraft.utils.schedule import warmup_lr


@dataclass(frozen=True, kw_only=True, slots=True)
class SpotConfig:
    """loss: a registered drafter loss (trainer/losses.py); token_budget: tokens per packed
    micro-batch; num_steps: unrolled steps of the loss (None: the drafter kind's default);
    device: where the drafter trains (cpu, cuda, cuda:N).
    lr_warmup_steps: the learning rate rises linearly to ``lr`` over this many micro-steps
    (0: ``lr`` from the first). The trainer starts from a converged drafter with a fresh
    AdamW, whose first updates move every weight by about ``lr`` whatever its gradient
    (``m / sqrt(v)`` of one gradient is its sign): at full ``lr`` that step costs the
    warmed-up drafter acceptance before the new data can pay for it.
    compute_dtype: the forward and backward's dtype (float32, or bfloat16 under autocast: the
    drafter's masters, its gradients and AdamW stay fp32; the loss's softmaxes run in fp32)."""

    loss: str = "eagle1"
    lr: float = 3e-4
    lr_warmup_steps: int = 0
    token_budget: int = 2048
    grad_clip: float = 1.0
    num_steps: int | None = None
    device: str = "cpu"
    compute_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise FastdraftError(f"drafter training compute dtype must be float32 or bfloat16, "
                                 f"got {self.compute_dtype!r}")
        if self.lr <= 0 or self.token_budget < 2 or self.grad_clip <= 0:
            raise FastdraftError("drafter online training: lr and grad_clip must be > 0 and "
                                 "token_budget >= 2")
        if self.lr_warmup_steps < 0:
            raise FastdraftError(f"drafter online training: lr_warmup_steps must be >= 0, got "
                                 f"{self.lr_warmup_steps}")
        if torch.device(self.device).type == "cuda" and not torch.cuda.is_available():
            raise FastdraftError(f"drafter online training on {self.device!r}, but this machine "
                                 "has no CUDA device: set drafter.online.device=cpu")

    def lr_at(self, step: int) -> float:
        """The learning rate of micro-step ``step`` (0-based, counted over the whole run)."""
        return warmup_lr(step, lr=self.lr, warmup_steps=self.lr_warmup_steps)


@dataclass(frozen=True, slots=True)
class HeldOutCheck:
    """The trained drafter against the one it would replace (the trainer's last published:
    the engine's), on the newest step's held-out rollouts: each one's expected accept length
    (drafter/acceptance.py), paired over the same `chains`."""

    candidate: float
    serving: float
    chains: int
    seconds: float = 0.0   # what scoring both took (the publish waits for it)

    @property
    def passed(self) -> bool:
        # A non-finite candidate passes: the loop's health check rejects it and restarts the
        # diverged trainer, where a withheld one would leave it training on NaNs.
        return not self.candidate < self.serving


@dataclass(frozen=True, slots=True)
class Published:
    version: int
    checksum: str
    tensors: list[tuple[str, torch.Tensor]]   # trainable tensors only, host copies
    check: HeldOutCheck | None = None         # None: nothing held out to check on
    # The hybrid worker whose process holds these tensors too (the trainer member that
    # published them): the pool broadcasts them from there over the workers' process group.
    held_by: int | None = None

    @property
    def withheld(self) -> bool:
        """The trained drafter lost to the serving one on the held-out rollouts: nothing to
        load (no tensors; the version is the serving one's)."""
        return self.check is not None and not self.check.passed


MAX_LATENCIES = 1000   # preemption latencies kept (the most recent)


@dataclass(slots=True)
class SpotStats:
    steps: int = 0
    steps_at_advance: int = 0        # `steps` when the current RL step began
    tokens: int = 0
    preemptions: int = 0
    last: dict[str, float] = field(default_factory=dict)
    preemption_latencies_s: list[float] = field(default_factory=list)
    device: str = "cpu"              # where the drafter trains (reported with every reply)

    @classmethod
    def of_state(cls, state: dict | None) -> SpotStats:
        """The counters a saved trainer state (SpotTrainer.state) continues from."""
        if state is None:
            return cls()
        steps = int(state.get("steps", 0))
        return cls(steps=steps, steps_at_advance=steps, tokens=int(state.get("tokens", 0)),
                   preemptions=int(state.get("preemptions", 0)))


class PolicyHead(nn.Module):
    """The policy's embedding and lm_head, all a drafter borrows (Drafter.attach reads them),
    as frozen copies."""

    def __init__(self, config, embed: torch.Tensor, lm_head: torch.Tensor | None) -> None:
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding.from_pretrained(embed.detach().clone())
        self.lm_head = nn.Linear(embed.shape[1], embed.shape[0], bias=False)
        self.lm_head.weight = (self.model.embed_tokens.weight if lm_head is None else
                               nn.Parameter(lm_head.detach().clone(), requires_grad=False))
        self.requires_grad_(False)

    @classmethod
    def of(cls, policy: nn.Module) -> PolicyHead:
        tied = policy.config.tie_word_embeddings
        return cls(policy.config, policy.model.embed_tokens.weight,
                   None if tied else policy.lm_head.weight)


class SpotTrainer:
    def __init__(self, drafter: Drafter, head: PolicyHead, buffer: DataBuffer,
                 cfg: SpotConfig = SpotConfig()) -> None:
        self.cfg, self.buffer = cfg, buffer
        self.device = torch.device(cfg.device)
        self.drafter = drafter.detached().to(self.device)
        # The policy's head and hidden states may come in the serving dtype (bf16); the
        # drafter trains in its own (fp32), and everything it reads is cast to it.
        self.dtype = next(self.drafter.parameters()).dtype
        self.head = head.to(self.device, self.dtype)
        self.drafter.attach(self.head).train()  # type: ignore[arg-type]
        self.optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=cfg.lr, weight_decay=0)
        self.version = 0
        # What the engine serves (the drafter given, then each publish): the held-out check's
        # reference. A resumed trainer's own weights may be newer than what it published.
        self.serving = [t.detach().cpu().clone() for _, t in trainable_named_tensors(drafter)]
        self._reference: Drafter | None = None   # scratch drafter the serving weights load into
        self.stats = SpotStats(device=str(next(self.drafter.parameters()).device))
        self._lock = threading.Lock()   # one micro-step at a time vs publish / sync

    def sync_policy(self, named_tensors) -> None:
        """The policy the next rollout samples from: its embedding and lm_head (HF names)."""
        wanted = {"model.embed_tokens.weight": self.head.model.embed_tokens.weight,
                  "lm_head.weight": self.head.lm_head.weight}
        with self._lock, torch.no_grad():
            for name, tensor in named_tensors:
                if name in wanted:
                    wanted[name].copy_(tensor.detach())

    def run(self, stop: threading.Event, max_steps: int | None = None) -> int:
        """Micro-steps until `stop` is set (or max_steps, or the buffer is empty); returns the
        number taken. `stop` may be any object with is_set() (a multiprocessing Event too)."""
        taken = 0
        while not stop.is_set() and (max_steps is None or taken < max_steps):
            if not self.step():
                break
            taken += 1
        if stop.is_set():
            self.record_preemption(_set_time(stop))
        return taken

    def record_preemption(self, stop_time: float) -> None:
        """stop_time: time.perf_counter() when the stop was asked for (CLOCK_MONOTONIC: one
        clock for every process of the machine)."""
        self.stats.preemptions += 1
        latencies = self.stats.preemption_latencies_s
        latencies.append(max(time.perf_counter() - stop_time, 0.0))
        # The stats cross to the loop at every publish: a run of days keeps the recent ones.
        del latencies[:-MAX_LATENCIES]

    def step(self, reduce: GradReduce | None = None) -> bool:
        """One micro-step; False when the buffer has nothing to train on. reduce: data-parallel
        training (workers/trainer_group.py): the members' gradients combined before the
        optimizer step, every member taking part even with nothing to train on (then its
        gradient is zero and weighs nothing); False when no member had anything."""
        packed = self.buffer.sample(self.cfg.token_budget, rows=True)
        if packed is None and reduce is None:
            return False
        tokens, metrics = 0, self.stats.last
        with self._lock:
            self.optimizer.zero_grad(set_to_none=True)
            if packed is not None:
                batch = draft_batch(packed, self.dtype).to(self.device)
                options = {} if self.cfg.num_steps is None else {"num_steps": self.cfg.num_steps}
                with torch.autocast(self.device.type, dtype=torch.bfloat16,
                                    enabled=self.cfg.compute_dtype == "bfloat16"):
                    loss, metrics = compute_drafter_loss(self.cfg.loss, self.drafter, batch,
                                                         self.head.lm_head, **options)
                loss.backward()
                tokens = int(packed.loss_mask.sum())
            if reduce is not None and not reduce(self.trainable(), tokens):
                return False
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.grad_clip)
            for group in self.optimizer.param_groups:
                group["lr"] = self.cfg.lr_at(self.stats.steps)
            self.optimizer.step()
        self.stats.steps += 1
        self.stats.tokens += tokens
        self.stats.last = metrics
        return True

    def trainable(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer steps, in its order (what data-parallel members share)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def state(self) -> dict:
        """What a resumed run needs to continue training exactly here: the drafter's trainable
        tensors, its optimizer, the version, counters, the RNGs (torch's and the buffer's
        sampling one) and the buffer's step (the samples themselves are not kept: a resumed
        run refills the buffer in one step). Tensors on the host."""
        with self._lock:
            state = {"drafter": {n: t.detach().cpu().clone()
                                 for n, t in trainable_named_tensors(self.drafter)},
                     "optimizer": _to_host(self.optimizer.state_dict()),
                     "version": self.version, "steps": self.stats.steps,
                     "tokens": self.stats.tokens, "preemptions": self.stats.preemptions,
                     "rng": torch.get_rng_state(), "buffer_rng": self.buffer.rng_state(),
                     "buffer_step": self.buffer.step}
            if self.device.type == "cuda":
                state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
            return state

    def load_state(self, state: dict) -> None:
        """Continues from `state`. Keys it lacks stay as built: a restart that has only the
        last good drafter (no trainer state saved yet) passes drafter, version and counters."""
        with self._lock, torch.no_grad():
            params = dict(self.drafter.named_parameters())
            for name, tensor in state["drafter"].items():
                params[name].copy_(tensor)
            if "optimizer" in state:
                self.optimizer.load_state_dict(state["optimizer"])
            self.version = int(state.get("version", self.version))
            counters = SpotStats.of_state(state)
            self.stats.steps = self.stats.steps_at_advance = counters.steps
            self.stats.tokens, self.stats.preemptions = counters.tokens, counters.preemptions
            if "rng" in state:
                torch.set_rng_state(state["rng"])
            if "cuda_rng" in state and self.device.type == "cuda":
                torch.cuda.set_rng_state(state["cuda_rng"], self.device)
            if "buffer_rng" in state:
                self.buffer.set_rng_state(state["buffer_rng"])
            while self.buffer.step < int(state.get("buffer_step", 0)):
                self.buffer.advance_step()

    def publish(self) -> Published:
        """The trainable tensors (host copies), a new version and their checksum; withheld
        (no tensors, the version unchanged) when the buffer holds rollouts out and the
        trained drafter's expected accept length on them is below the serving one's."""
        with self._lock:
            check = self._held_out_check()
            if check is not None and not check.passed:
                return Published(self.version, "", [], check)
            tensors = [(n, t.detach().cpu().clone())
                       for n, t in trainable_named_tensors(self.drafter)]
            self.version += 1
            self.serving = [t for _, t in tensors]
        return Published(self.version, tensor_digest(tensors), tensors, check)

    def _held_out_check(self) -> HeldOutCheck | None:
        """With _lock held: both drafters on the held-out rollouts (None: there are none)."""
        start = time.perf_counter()
        batches = self.buffer.held_out(self.cfg.token_budget)
        if not batches:
            return None
        if self._reference is None:
            self._reference = self.drafter.detached().to(self.device).attach(self.head)
        with torch.no_grad():
            for param, tensor in zip(self._reference.parameters(), self.serving):
                param.copy_(tensor)
        steps = self.cfg.num_steps or DEFAULT_NUM_STEPS[self.drafter.kind]
        scores = []
        for drafter in (self.drafter, self._reference):
            total = AcceptEstimate(0.0, 0)
            for packed in batches:
                b = draft_batch(packed, self.dtype).to(self.device)
                total += expected_accept(drafter, b.input_ids, b.hidden, b.valid,
                                         self.head.lm_head, steps, b.segments, b.positions)
            scores.append(total)
        return HeldOutCheck(scores[0].mean, scores[1].mean, scores[0].chains,
                            time.perf_counter() - start)


#: (the trainable parameters, with their gradients of this member's batch; its tokens) ->
#: whether the combined gradients are in place (False: no member had tokens).
GradReduce = Callable[[list[torch.nn.Parameter], int], bool]


class StopEvent(threading.Event):
    """An Event that remembers when it was set (for the preemption latency)."""

    def __init__(self) -> None:
        super().__init__()
        self.set_at = 0.0

    def set(self) -> None:
        self.set_at = time.perf_counter()
        super().set()


def _set_time(stop: threading.Event) -> float:
    return getattr(stop, "set_at", time.perf_counter()) or time.perf_counter()


def _to_host(tree):
    """A state tree with its tensors copied to the host (optimizer moments live on the
    device; what leaves the trainer must not pin device memory or need CUDA to be read)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().clone()
    if isinstance(tree, dict):
        return {k: _to_host(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_host(v) for v in tree)
    return tree


def draft_batch(packed: PackedBatch, dtype: torch.dtype = torch.float32) -> DraftBatch:
    """The packed rows as the loss reads them, hidden states in the drafter's dtype."""
    rewards = packed.rewards.float()
    known = ~torch.isnan(rewards)
    # A sample of the current rollout is not scored yet: it weighs like the average known one.
    fill = rewards[known].mean() if known.any() else torch.tensor(1.0)
    return DraftBatch(packed.input_ids, packed.hidden_states(dtype), packed.loss_mask,
                      torch.where(known, rewards, fill), packed.segment_ids, packed.positions)
