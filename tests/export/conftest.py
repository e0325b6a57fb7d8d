"""Tiny policies (one per family the exporter distinguishes) and saved drafters for them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastdraft.drafter import Drafter, build_drafter, save_drafter
from fastdraft.engine.spec.draft_head import DraftHead
from fastdraft.models import CausalLM, load_model
from tests.conftest import make_tiny_checkpoint

MAX_POSITIONS = 32


@pytest.fixture(scope="session")
def llama_policy_dir(tmp_path_factory) -> Path:
    # Untied, so an EAGLE-3 export reads lm_head.weight itself; 4 layers for distinct aux layers.
    path = tmp_path_factory.mktemp("llama-policy")
    make_tiny_checkpoint(path, model_type="llama", num_hidden_layers=4, tie_word_embeddings=False)
    return path


@pytest.fixture(scope="session")
def qwen2_policy_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen2-policy")  # tied: lm_head is the embedding
    make_tiny_checkpoint(path, model_type="qwen2")
    return path


def saved_drafter(policy: CausalLM, kind: str, out: Path, seed: int = 0,
                  draft_token_ids: list[int] | None = None) -> Drafter:
    """A random drafter whose weights are bfloat16 values (the export's dtype), so an exported
    and reloaded copy must compute bit-identical outputs."""
    torch.manual_seed(seed)
    drafter = build_drafter(kind, policy.config, MAX_POSITIONS).attach(policy)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # norms away from 1, biases away from 0
            p.copy_(p.to(torch.bfloat16).float())
    if draft_token_ids is not None:
        drafter.draft_token_ids = torch.tensor(draft_token_ids)
    save_drafter(drafter, out)
    return drafter.eval()


def load_policy(path: Path) -> CausalLM:
    return load_model(path, max_positions=MAX_POSITIONS)


def assert_same_steps(original: Drafter, reloaded: Drafter) -> None:
    """The reloaded drafter computes bit-identical features, logits and draft logits."""
    torch.manual_seed(7)
    features = torch.randn(2, 5, original.config.hidden_size)
    ids = torch.randint(0, original.config.vocab_size, (2, 5))
    positions = torch.arange(1, 6).expand(2, -1)
    with torch.no_grad():
        want_out, want_logits = original.step(features, ids, positions)
        got_out, got_logits = reloaded.step(features, ids, positions)
        assert torch.equal(got_out, want_out)
        assert torch.equal(got_logits, want_logits)
        want_draft = DraftHead(original).logits(want_out)
        assert torch.equal(DraftHead(reloaded).logits(got_out), want_draft)
