"""The proposer contract between the engine and every draft source, and their registry.

Per step the engine calls `propose` (a DraftBatch: one tree per running request), verifies them with
the policy, then hands each request's newly committed tokens to `on_commit` together with the
policy's hidden states of the tokens before them, so a drafter can keep its own cache in step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fastdraft.engine.request import Request
from fastdraft.engine.spec.batch import DraftBatch
from fastdraft.engine.spec.config import SpecConfig


@dataclass(frozen=True, slots=True)
class Committed:
    """Tokens a request just committed (prefill: prompt[1:] + first token; a spec step: the
    accepted path + the bonus token). final/aux: the policy's hidden states of the token BEFORE
    each new token, [m, H] each; token_ids[0] sits at position start_pos."""

    request: Request
    token_ids: list[int]
    start_pos: int
    final: torch.Tensor
    aux: tuple[torch.Tensor, ...]


class Proposer:
    """Base class: a proposer that drafts nothing (plain decoding through the spec path)."""

    source_id = 0
    aux_layers: tuple[int, ...] = ()

    def on_commit(self, committed: list[Committed]) -> None:
        """Called after prefill and after every verify step (finished requests excluded)."""

    def propose(self, requests: list[Request], cfg: SpecConfig) -> DraftBatch:
        return DraftBatch.empty(len(requests))

    def on_finish(self, request: Request) -> None:
        """Called once when a request finishes (frees per-request state)."""

    def advance_step(self, step: int) -> None:
        """An RL step ended (model-free sources slide their window)."""


ProposerFactory = Callable[..., Proposer]
PROPOSERS: dict[str, ProposerFactory] = {}


def register_proposer(name: str) -> Callable[[ProposerFactory], ProposerFactory]:
    def wrap(factory: ProposerFactory) -> ProposerFactory:
        PROPOSERS[name] = factory
        return factory
    return wrap


def build_proposer(name: str, **kwargs: Any) -> Proposer:
    if name not in PROPOSERS:
        raise ValueError(f"unknown spec method {name!r}; choose one of {sorted(PROPOSERS)}")
    return PROPOSERS[name](**kwargs)
