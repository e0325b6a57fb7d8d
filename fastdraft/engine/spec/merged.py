"""The multi-source proposer ("eagle+suffix"): EAGLE's tree with the suffix drafter's candidates
grafted in, verified as one tree within the step's verify budget.

In an RL rollout's tail the remaining requests are long answers to prompts whose other samples
have already finished; the suffix drafter then proposes long runs copied from those siblings,
which EAGLE's shallow tree cannot reach, while EAGLE covers what no sibling wrote. The budget
of `tokens_to_verify` nodes is split: up to `suffix_share` for suffix nodes not already in
EAGLE's tree (one chain of the arm's depth, at most half the budget), the rest for EAGLE.
EAGLE drafts inside the step (a captured stage); the graft runs on the host after it
(`after_draft`), like any host proposer's trees. The same proposer serves plain "eagle" arms.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from fastdraft.config.engine import MERGED, SpecConfig
from fastdraft.engine.request import Request
from fastdraft.engine.spec.eagle import EagleProposer, create_eagle_proposer
from fastdraft.engine.spec.graft import graft, graft_into
from fastdraft.engine.spec.proposer import Proposer, register_proposer
from fastdraft.engine.spec.suffix_proposer import SuffixProposer
from fastdraft.engine.step_io import SamplingMode, StepIO

if TYPE_CHECKING:
    from fastdraft.engine.prefix_share import SharedPrefill
    from fastdraft.engine.scheduler import SlotMove
    from fastdraft.models import HiddenStates

def suffix_share(cfg: SpecConfig) -> int:
    """Suffix nodes of a merged arm's budget: one chain of its depth, at most half."""
    return min(cfg.depth, cfg.tokens_to_verify // 2) if cfg.method == MERGED else 0


class MergedProposer(Proposer):
    drafts_on_device = True

    def __init__(self, eagle: EagleProposer, suffix: SuffixProposer) -> None:
        self.eagle, self.suffix = eagle, suffix
        self.drafter = eagle.drafter   # the engine's model_drafter (online updates, export)

    @property
    def aux_layers(self) -> tuple[int, ...]:  # type: ignore[override]
        return self.eagle.aux_layers

    def _eagle_cfg(self, cfg: SpecConfig) -> SpecConfig:
        return replace(cfg, method="eagle",
                       tokens_to_verify=cfg.tokens_to_verify - suffix_share(cfg))

    def draft_width(self, cfg: SpecConfig) -> int:
        return self.eagle.draft_width(self._eagle_cfg(cfg)) + suffix_share(cfg)

    def draft(self, io: StepIO, batch: int, ctx_len: int, cfg: SpecConfig,
              mode: SamplingMode) -> None:
        self.eagle.draft(io, batch, ctx_len, self._eagle_cfg(cfg), mode)

    def after_draft(self, io: StepIO, requests: list[Request], cfg: SpecConfig,
                    batch: int) -> None:
        share = suffix_share(cfg)
        if not share:
            return
        assert io.drafts is not None
        base_width = self.eagle.draft_width(self._eagle_cfg(cfg))
        base = io.drafts.view(len(requests), base_width, sampled=False)
        num_nodes = base.num_nodes.tolist()
        tokens, parents = base.tokens.tolist(), base.parents.tolist()
        base_parents, grafts = [], []
        for b, request in enumerate(requests):
            n = num_nodes[b]
            base_parents.append(parents[b][:n])
            # Extra candidates beyond the share: those EAGLE already has cost nothing.
            extra = self.suffix.tree(request, share + cfg.depth, cfg.depth)
            grafts.append(graft(tokens[b][:n], base_parents[b], extra.tokens.tolist(),
                                extra.parents.tolist(), share))
        graft_into(io.drafts, batch, base_width, base_width + share, base_parents, grafts,
                   self.suffix.source_id)

    # Everything else: EAGLE keeps its cache in step, the suffix drafter its token history.
    def on_prefill(self, requests: list[Request], hidden: HiddenStates, slot_start: int,
                   first_tokens: torch.Tensor, share: SharedPrefill | None = None) -> None:
        self.eagle.on_prefill(requests, hidden, slot_start, first_tokens, share)

    def on_tokens(self, request: Request, new_token_ids: list[int]) -> None:
        self.suffix.on_tokens(request, new_token_ids)

    def commit(self, io: StepIO, batch: int, ctx_len: int, width: int | None = None,
               start: int = 0) -> None:
        self.eagle.commit(io, batch, ctx_len, width, start)

    def on_finish(self, request: Request) -> None:
        self.suffix.on_finish(request)

    def on_preempt(self, request: Request) -> None:
        self.suffix.on_preempt(request)

    def advance_step(self, step: int) -> None:
        self.suffix.advance_step(step)

    def state_dict(self) -> dict[str, Any]:
        return self.suffix.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.suffix.load_state_dict(state)

    def move(self, moves: list[SlotMove]) -> None:
        self.eagle.move(moves)

    def refresh(self) -> None:
        self.eagle.refresh()


@register_proposer(MERGED)
def create_merged_proposer(**kwargs: object) -> MergedProposer:
    return MergedProposer(create_eagle_proposer(**kwargs), SuffixProposer(**kwargs))
