"""The engine-facing wrapper of the model-free suffix drafter: feeds it each request's prompt and
committed tokens, and every finished rollout as a source for later rollouts of the same prompt.
A host proposer: trees are built in plain Python before the step and copied in."""

from __future__ import annotations

from typing import Any

import torch

from fastdraft.config.engine import SpecConfig
from fastdraft.engine.request import Request
from fastdraft.engine.spec.batch import DraftBatch
from fastdraft.engine.spec.proposer import Proposer, register_proposer
from fastdraft.engine.spec.suffix import SuffixConfig, SuffixDrafter
from fastdraft.engine.spec.tree import DraftTree
from fastdraft.models import CausalLM


@register_proposer("suffix")
class SuffixProposer(Proposer):
    source_id = 1

    def __init__(self, *, model: CausalLM | None = None, suffix: SuffixConfig | None = None,
                 **_: object) -> None:
        self.drafter = SuffixDrafter(suffix or SuffixConfig())
        # Trees are built on the host (plain Python) and handed over on the policy's device.
        self.device = next(model.parameters()).device if model is not None else torch.device("cpu")
        self._started: set[int] = set()
        self.step = 0

    @staticmethod
    def _key(request: Request) -> int:
        return id(request)

    def on_tokens(self, request: Request, new_token_ids: list[int]) -> None:
        key = self._key(request)
        if key not in self._started:  # its prefill: the prompt, then the first token
            self.drafter.start(key, tuple(request.prompt_token_ids), request.prompt_token_ids)
            self._started.add(key)
        self.drafter.extend(key, new_token_ids)

    def propose(self, requests: list[Request], cfg: SpecConfig) -> DraftBatch:
        return DraftBatch.from_trees([self.tree(r, cfg.tokens_to_verify, cfg.depth)
                                      for r in requests], device="cpu", source_id=self.source_id)

    def tree(self, request: Request, num_nodes: int, max_depth: int) -> DraftTree:
        """One request's best-first tree (empty before its prefill)."""
        key = self._key(request)
        if key not in self._started:
            return DraftTree.empty()
        return self.drafter.propose(key, num_nodes, max_depth)

    def on_preempt(self, request: Request) -> None:
        key = self._key(request)
        if key in self._started:
            self.drafter.finish(key)
            self._started.discard(key)

    def on_finish(self, request: Request) -> None:
        self.on_preempt(request)   # its matching state goes; its answer becomes a source
        self.drafter.add_rollout(tuple(request.prompt_token_ids), request.output_token_ids,
                                 self.step)

    def advance_step(self, step: int) -> None:
        self.step = step
        self.drafter.advance_step(step)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "window": self.drafter.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.drafter.load_state_dict(state["window"])
