"""The accept length a drafter would reach on given rollouts, estimated offline from the
training-time test (drafter/losses.unrolled_steps), so two drafters can be compared on the
same held-out tokens before one of them is served.

A chain drafted from pair index t proposes at depth j+1 a token of the drafter's step-j
distribution q_j at index t (the unrolled step sees what that node sees at inference). Drafts
sampled from q and verified by rejection sampling against the policy's p (temperature 1, the
RL rollout's) survive with probability a = sum_x min(p(x), q(x)) = 1 - TV(p, q), so the chain
from t accepts its first k drafts with probability prod_{j<k} a_j(t) and

    expected accept length = 1 + sum_k prod_{j<k} a_j(t)          (the 1: the verify's own token)

averaged over the pair indices that step 0 scores; a depth past the sequence's end accepts
nothing. Checked against the engine: a chain of depth 3 (topk 1) on the miniature's policy and
warmed-up EAGLE-3 drafter measured 3.858 accepted tokens a verify, this estimate 3.856
(tests/drafter/test_acceptance.py does the same on a tiny policy). The chain's later inputs are
the rollout's tokens, which the accepted drafts equal only in law, and a tree accepts more than
its first chain; the estimate is the same for both drafters and paired over the same tokens,
which is what a comparison needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdraft.drafter.base import Drafter
from fastdraft.drafter.losses import unrolled_steps
from fastdraft.models import HiddenStates


@dataclass(frozen=True, slots=True)
class AcceptEstimate:
    """total: the sum over the chains of their expected accept length; chains: how many."""

    total: float
    chains: int

    @property
    def mean(self) -> float:
        return self.total / self.chains if self.chains else float("nan")

    def __add__(self, other: AcceptEstimate) -> AcceptEstimate:
        return AcceptEstimate(self.total + other.total, self.chains + other.chains)


def chain_accept(survive: list[torch.Tensor], scored: list[torch.Tensor]) -> AcceptEstimate:
    """survive[j], scored[j]: [B, L] probability that depth j+1's draft survives, and whether
    it is scored there. Chains start where depth 1 is scored; an unscored depth ends a chain."""
    starts = scored[0]
    alive = torch.ones_like(survive[0])
    expected = torch.ones_like(survive[0])
    for a, ok in zip(survive, scored):
        alive = alive * a * ok
        expected = expected + alive
    return AcceptEstimate(float(expected[starts].sum()), int(starts.sum()))


@torch.no_grad()
def expected_accept(drafter: Drafter, input_ids: torch.Tensor, hidden: HiddenStates,
                    valid: torch.Tensor, lm_head: torch.nn.Module, num_steps: int,
                    segments: torch.Tensor | None = None,
                    positions: torch.Tensor | None = None) -> AcceptEstimate:
    """The chains of depth num_steps from every scored pair of the batch (shapes as
    unrolled_steps; packed rows give the same estimate as the sequences padded apart)."""
    survive, scored = [], []
    for s in unrolled_steps(drafter, input_ids, hidden, valid, lm_head, num_steps, segments,
                            positions):
        survive.append(torch.minimum(s.target_probs, s.logits.float().softmax(-1)).sum(-1))
        scored.append(s.scored)
    return chain_accept(survive, scored)
