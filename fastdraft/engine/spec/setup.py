"""Builds the proposer a SpecConfig names. Factories load what they need themselves (the EAGLE
factory loads the drafter and checks it against the policy, so a mismatched checkpoint fails at
engine construction, not mid-rollout)."""

from __future__ import annotations

from pathlib import Path

from fastdraft.config.engine import SpecConfig
from fastdraft.engine.envelope import Envelope
from fastdraft.engine.spec.proposer import PROPOSERS, Proposer
from fastdraft.models import CausalLM


def known_methods() -> list[str]:
    # Importing registers the built-in proposers.
    from fastdraft.engine.spec import eagle, merged, suffix_proposer  # noqa: F401
    return ["none", *sorted(PROPOSERS)]


def make_proposer(spec: SpecConfig, model: CausalLM, drafter: str | Path | None,
                  num_slots: int, envelope: Envelope, compile: bool = False) -> Proposer:
    """Every registered factory takes the same keywords and ignores what it does not need."""
    if not spec.enabled:
        return Proposer()
    known_methods()  # registers the built-in proposers
    return PROPOSERS[spec.method](model=model, drafter_path=drafter, num_slots=num_slots,
                                  envelope=envelope, spec=spec, compile=compile)
