"""A packed forward equals each sequence's forward alone, and so do the loss and its gradient.

Hidden states are the model's own (as the engine's sink would record them), so the samples are
realistic; logits are compared in fp32 to 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastdraft.databuffer import Sample, pack, pad, token_ce_loss
from fastdraft.drafter import build_drafter
from fastdraft.drafter.losses import drafter_loss
from fastdraft.models import CausalLM
from tests.databuffer.helpers import VOCAB, tiny_lm

LENGTHS = (5, 11, 3, 8)
PROMPT = 2


def _rollouts(model: CausalLM, aux_layers: tuple[int, ...] = ()) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(0, VOCAB, (n,), generator=g)
        with torch.no_grad():
            _, hidden = model(ids[None], torch.arange(n)[None], aux_layers=aux_layers)
        out.append(Sample(request_index=i, policy_version=0, rl_step=0, token_ids=ids,
                          positions=torch.arange(n), hidden=hidden.final[0],
                          aux_hidden=tuple(a[0] for a in hidden.aux),
                          loss_mask=torch.arange(n) >= PROMPT))
    return out


def _alone(model: CausalLM, s: Sample) -> torch.Tensor:
    """[T, V] logits of the sequence run alone (plain causal attention)."""
    return model(s.token_ids[None], s.positions[None])[0][0]


def _reference_loss(logits: torch.Tensor, s: Sample) -> torch.Tensor:
    """Mean next-token CE over the sequence's answer tokens, computed independently."""
    ce = F.cross_entropy(logits[:-1], s.token_ids[1:], reduction="none")
    return ce[s.loss_mask[1:]].mean()


@pytest.mark.parametrize("layout", ["packed", "packed_to_budget", "padded"])
def test_batched_logits_equal_each_sequence_alone(layout: str) -> None:
    model = tiny_lm()
    samples = _rollouts(model)
    batch = {"packed": lambda: pack(samples, 40),
             "packed_to_budget": lambda: pack(samples, 40, pad_to_budget=True),
             "padded": lambda: pad(samples)}[layout]()
    with torch.no_grad():
        logits, hidden = model(batch.input_ids, batch.positions, attn=batch.attn_meta())
        assert torch.isfinite(logits).all()  # padding slots too (they see themselves)
        for i, s in enumerate(samples):
            rows, cols = torch.nonzero(batch.segment_ids == i, as_tuple=True)
            torch.testing.assert_close(logits[rows, cols], _alone(model, s), rtol=0, atol=1e-5)
            # the stored states (bf16) are the model's own states at those slots
            torch.testing.assert_close(batch.hidden[rows, cols],
                                       hidden.final[rows, cols].to(torch.bfloat16))


def test_packing_without_the_block_mask_would_leak_across_sequences() -> None:
    """The equality above is not vacuous: plain causal attention over the row differs."""
    model = tiny_lm()
    samples = _rollouts(model)
    batch = pack(samples, 40)
    with torch.no_grad():
        leaky, _ = model(batch.input_ids, batch.positions)
    second = slice(LENGTHS[0], LENGTHS[0] + LENGTHS[1])
    assert (leaky[0, second] - _alone(model, samples[1])).abs().max() > 1e-3


def test_packed_loss_and_gradients_equal_the_per_sequence_average() -> None:
    model = tiny_lm()
    samples = _rollouts(model)
    params = [p for p in model.parameters() if p.requires_grad]

    batch = pack(samples, 40, pad_to_budget=True)
    logits, _ = model(batch.input_ids, batch.positions, attn=batch.attn_meta())
    packed_loss, metrics = token_ce_loss(logits, batch)
    packed_grads = torch.autograd.grad(packed_loss, params)

    per_seq = torch.stack([_reference_loss(_alone(model, s), s) for s in samples])
    ref_loss = per_seq.mean()
    ref_grads = torch.autograd.grad(ref_loss, params)

    torch.testing.assert_close(packed_loss, ref_loss, rtol=0, atol=1e-5)
    for got, want in zip(packed_grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert metrics["scored_sequences"] == len(LENGTHS)
    assert metrics["scored_tokens"] == sum(n - PROMPT for n in LENGTHS)

    padded = pad(samples)
    with torch.no_grad():
        padded_logits, _ = model(padded.input_ids, padded.positions, attn=padded.attn_meta())
    torch.testing.assert_close(token_ce_loss(padded_logits, padded)[0], ref_loss.detach(),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_padded_batches_feed_the_drafter_losses(kind: str) -> None:
    """drafter/losses.py scores [B, T] rows with positions 0..T-1 and a causal mask: exactly a
    padded batch (right padding never reaches a real token, and loss_mask is False on it)."""
    policy = tiny_lm()
    for p in policy.parameters():
        p.requires_grad_(False)
    torch.manual_seed(0)
    drafter = build_drafter(kind, policy.config, 64).attach(policy)
    batch = pad(_rollouts(policy, drafter.aux_layers))
    assert len(batch.aux_hidden) == len(drafter.aux_layers)
    loss, metrics = drafter_loss(drafter, batch.input_ids, batch.hidden_states(),
                                 batch.loss_mask, policy.lm_head, num_steps=2)
    loss.backward()
    assert torch.isfinite(loss) and 0.0 <= metrics["top1_acc"] <= 1.0
    assert all(p.grad is not None for p in drafter.parameters() if p.requires_grad)
