"""Builds the proposer a SpecConfig names (the drafter is loaded and checked against the policy
here, so a mismatched checkpoint fails at engine construction, not mid-rollout)."""

from __future__ import annotations

from pathlib import Path

from fastdraft.engine.spec.config import SpecConfig
from fastdraft.engine.spec.proposer import PROPOSERS, Proposer
from fastdraft.models import CausalLM


def known_methods() -> list[str]:
    # Importing registers the built-in proposers.
    from fastdraft.engine.spec import eagle, suffix_proposer  # noqa: F401
    return ["none", *sorted(PROPOSERS)]


def make_proposer(spec: SpecConfig, model: CausalLM, drafter: str | Path | None,
                  num_slots: int, cache_len: int, rope_len: int, compile: bool = False
                  ) -> Proposer:
    if not spec.enabled:
        return Proposer()
    if spec.method == "eagle":
        if drafter is None:
            raise ValueError("spec method 'eagle' needs drafter=PATH: train one with "
                             "`fastdraft drafter warmup --policy DIR`")
        from fastdraft.drafter import load_drafter
        drafter_positions = cache_len + max(spec.depth - 1, 0) * spec.topk + spec.depth + 2
        loaded = load_drafter(drafter, model, max_positions=max(rope_len, drafter_positions))
        return PROPOSERS["eagle"](drafter=loaded, num_slots=num_slots, cache_len=cache_len,
                                  spec=spec, compile=compile)
    return PROPOSERS[spec.method](num_slots=num_slots, cache_len=cache_len, spec=spec)
