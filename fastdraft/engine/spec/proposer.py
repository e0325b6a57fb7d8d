"""The proposer contract between the engine and every draft source, and their registry.

Two kinds of proposer:
- host proposers (model-free ones: suffix) build each request's tree in plain Python with
  `propose`; the engine copies the trees into the step's static buffers;
- device proposers (`drafts_on_device`, EAGLE) draft inside the step, as captured stages:
  `draft` writes the step's DraftBuffers (`after_draft` may then add host-built nodes: the
  multi-source proposer), `commit` runs the drafter over what the policy accepted (with the
  policy's hidden states, left in the step's buffers by verify).
Both see every request's new tokens (`on_tokens`) and its prefill (`on_prefill`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from fastdraft.config.engine import SpecConfig
from fastdraft.engine.request import Request
from fastdraft.engine.spec.batch import DraftBatch
from fastdraft.errors import FastdraftError

if TYPE_CHECKING:
    from fastdraft.engine.prefix_share import SharedPrefill
    from fastdraft.engine.scheduler import SlotMove
    from fastdraft.engine.step_io import SamplingMode, StepIO
    from fastdraft.models import HiddenStates


class Proposer:
    """Base class: a proposer that drafts nothing (plain decoding through the spec path)."""

    source_id = 0
    aux_layers: tuple[int, ...] = ()
    drafts_on_device = False

    def on_prefill(self, requests: list[Request], hidden: HiddenStates, slot_start: int,
                   first_tokens: torch.Tensor, share: SharedPrefill | None = None) -> None:
        """Device work after a prefill of slots slot_start..: hidden [m, T, H] of the prompts,
        first_tokens [m] (finished requests included: their slots are simply freed); share:
        which rows hold equal prompts (a GRPO group; None: every row its own)."""

    def on_tokens(self, request: Request, new_token_ids: list[int]) -> None:
        """Host: tokens a still-running request just appended (prefill: its first token)."""

    def propose(self, requests: list[Request], cfg: SpecConfig) -> DraftBatch:
        """Host proposers: one tree per request (width <= cfg.tokens_to_verify)."""
        return DraftBatch.empty(len(requests))

    def draft_width(self, cfg: SpecConfig) -> int:
        """Nodes per row of the trees this proposer sends to the policy."""
        return cfg.tokens_to_verify

    def draft(self, io: StepIO, batch: int, ctx_len: int, cfg: SpecConfig,
              mode: SamplingMode) -> None:
        """Device proposers: a captured stage that writes io.drafts for rows 0..batch-1."""
        raise NotImplementedError

    def after_draft(self, io: StepIO, requests: list[Request], cfg: SpecConfig,
                    batch: int) -> None:
        """Device proposers: host work after the draft stage, outside any captured graph
        (a multi-source proposer grafts host-built candidates into io.drafts here)."""

    def commit(self, io: StepIO, batch: int, ctx_len: int, width: int | None = None,
               start: int = 0) -> None:
        """Device proposers: a captured stage after verify over rows start..start+batch-1
        (io.accepted_ids, io.num_accepted, io.commit_final / commit_aux hold what the policy
        accepted and its hidden states)."""

    def on_finish(self, request: Request) -> None:
        """Called once when a request finishes (frees per-request state)."""

    def on_preempt(self, request: Request) -> None:
        """A running request was preempted (engine/paged_kv.py): it will be prefilled again
        (on_prefill) and continue. Per-request state may go; what it produced is no source
        yet (its answer is unfinished)."""

    def advance_step(self, step: int) -> None:
        """An RL step ended (model-free sources slide their window)."""

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to propose as an unbroken one would (JSON): model-free
        sources' rollout windows. Per-request state is not kept: a checkpoint falls between
        rollouts."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores `state_dict()`."""

    def move(self, moves: list[SlotMove]) -> None:
        """Running requests changed slots (scheduler compaction): move per-slot state."""

    def refresh(self) -> None:
        """The policy's weights changed in place (anything derived from them is rebuilt)."""


ProposerFactory = Callable[..., Proposer]
PROPOSERS: dict[str, ProposerFactory] = {}


def register_proposer(name: str) -> Callable[[ProposerFactory], ProposerFactory]:
    def wrap(factory: ProposerFactory) -> ProposerFactory:
        PROPOSERS[name] = factory
        return factory
    return wrap


def build_proposer(name: str, **kwargs: Any) -> Proposer:
    if name not in PROPOSERS:
        raise FastdraftError(f"unknown spec method {name!r}; choose one of {sorted(PROPOSERS)}")
    return PROPOSERS[name](**kwargs)
