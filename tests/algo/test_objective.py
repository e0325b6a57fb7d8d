"""The algorithm as the actor calls it: a non-finite sequence is skipped (counted), never a crash;
the presets resolve to what they say (dr_grpo: std off and length-unbiased aggregation; dapo's
clip_high default); micro-batches on any rank sum to the whole batch's loss."""

from __future__ import annotations

import pytest
import torch

from fastdraft.algo.objective import Algorithm
from fastdraft.algo.sequences import build_batch
from fastdraft.config.sections import AlgorithmConfig

NAN, INF = float("nan"), float("inf")


def _batch(old: list[list[float]] | None = None, advantages=(1.0, -0.5, 2.0, -1.0)):
    """4 samples with answers of 2, 3, 1 and 4 tokens after 2-token prompts."""
    answers = [[5, 6], [7, 8, 9], [4], [3, 4, 5, 6]]
    old = old or [[-1.0] * len(a) for a in answers]
    return build_batch([[1, 2]] * 4, answers, old, list(advantages))


def _actor_logprobs(batch, shift: float = 0.05) -> torch.Tensor:
    """The actor's logprobs [B, L - 1]: the engine's + shift on the answer, garbage elsewhere."""
    lp = torch.where(batch.mask, batch.old_logprobs + shift, torch.full_like(
        batch.old_logprobs, NAN))
    return lp.requires_grad_()


def _loss(algo, batch, logprobs, rows=None, total=None):
    """rows: one micro-batch of `batch`; total given: the objective sees no batch, as on a
    rank that holds only its own micro-batches."""
    objective = (algo.objective(batch, None) if total is None
                 else algo.objective(None, None, total=total))
    if rows is None:
        return objective(logprobs, batch)
    mb = batch.rows(rows)
    return objective(logprobs[rows, : mb.mask.shape[1]], mb)


@pytest.mark.parametrize("loss", ["grpo", "dapo"])
def test_a_non_finite_engine_logprob_or_advantage_skips_only_that_sequence(loss):
    algo = Algorithm(AlgorithmConfig(loss=loss), temperature=1.0)
    clean = _batch()
    for bad in (_batch(old=[[-1.0, NAN], [-1.0] * 3, [-1.0], [-1.0] * 4]),
                _batch(advantages=(INF, -0.5, 2.0, -1.0))):
        logprobs = _actor_logprobs(bad)
        got, metrics = _loss(algo, bad, logprobs)          # PolicyBatch inside: no exception
        assert metrics["actor/skipped_sequences"] == 1.0
        # exactly the loss of the batch without sample 0
        want, _ = _loss(algo, clean.rows([1, 2, 3]), _actor_logprobs(clean.rows([1, 2, 3])))
        assert got.item() == pytest.approx(want.item(), rel=1e-6)
        got.backward()
        assert torch.isfinite(logprobs.grad).all() and (logprobs.grad[0] == 0).all()
        assert (logprobs.grad[1:][bad.mask[1:]] != 0).any()


def test_a_non_finite_actor_logprob_skips_its_sequence_and_the_rest_still_learn():
    algo = Algorithm(AlgorithmConfig(), temperature=1.0)
    batch = _batch()
    logprobs = _actor_logprobs(batch).detach()
    logprobs[2, 1] = NAN                                   # sample 2's only answer token
    logprobs.requires_grad_()
    loss, metrics = _loss(algo, batch, logprobs)
    assert metrics["actor/skipped_sequences"] == 1.0 and torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(logprobs.grad).all() and (logprobs.grad[2] == 0).all()
    assert (logprobs.grad[0][batch.mask[0]] != 0).all()


def test_nothing_finite_left_gives_a_zero_loss_not_an_exception():
    algo = Algorithm(AlgorithmConfig(), temperature=1.0)
    batch = _batch(advantages=(NAN, NAN, NAN, NAN))
    logprobs = _actor_logprobs(batch)
    assert algo.normaliser(batch) == 0.0
    loss, metrics = _loss(algo, batch, logprobs)
    assert loss.item() == 0.0 and metrics["actor/skipped_sequences"] == 4.0
    loss.backward()                                        # zero gradient: the actor skips
    assert (logprobs.grad == 0).all()


@pytest.mark.parametrize("cfg", [AlgorithmConfig(), AlgorithmConfig(loss="dapo"),
                                 AlgorithmConfig(advantage="dr_grpo")])
def test_micro_batches_given_the_batch_normaliser_sum_to_the_batch_loss(cfg):
    """A rank that sees only some micro-batches builds its shares from the whole batch's
    normaliser (`total`), without the batch."""
    algo = Algorithm(cfg, temperature=1.0, max_tokens=6)
    batch = _batch()
    logprobs = _actor_logprobs(batch, shift=0.3)
    whole, _ = _loss(algo, batch, logprobs)
    total = algo.normaliser(batch)
    parts = [_loss(algo, batch, logprobs, rows, total=total)[0] for rows in ([0, 3], [1], [2])]
    assert sum(p.item() for p in parts) == pytest.approx(whole.item(), rel=1e-6)
    with pytest.raises(ValueError, match="needs the batch or its normaliser"):
        algo.objective(None, None)


def _token_grads(cfg: AlgorithmConfig) -> torch.Tensor:
    """d loss / d logprob per answer token at ratio 1, two samples of equal advantage and
    answer lengths 2 and 4."""
    algo = Algorithm(cfg, temperature=1.0, max_tokens=8)
    batch = build_batch([[1, 2]] * 2, [[5, 6], [3, 4, 5, 6]], [[-1.0] * 2, [-1.0] * 4],
                        [1.0, 1.0])
    logprobs = batch.old_logprobs.clone().requires_grad_()
    algo.objective(batch, None)(logprobs, batch)[0].backward()
    return logprobs.grad[batch.mask]


def test_dr_grpo_is_length_unbiased_where_scale_std_false_alone_is_not():
    dr = AlgorithmConfig(advantage="dr_grpo")
    algo = Algorithm(dr, temperature=1.0, max_tokens=8)
    assert algo.aggregation == "seq-mean-token-sum-norm" and algo.options["max_tokens"] == 8
    # every token of either answer weighs the same: -A / (max_tokens * sequences)
    torch.testing.assert_close(_token_grads(dr), torch.full((6,), -1 / 16))
    # grpo's std division off, aggregation untouched: a long answer's tokens weigh less
    grads = _token_grads(AlgorithmConfig(scale_std=False))
    assert grads[0] == pytest.approx(-1 / 4) and grads[-1] == pytest.approx(-1 / 8)
    rewards = [1.0, 0.0, 0.0, 0.0]                        # no std division: 0.75, -0.25, ...
    assert algo.advantages(rewards, 4)[0] == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_unset_options_resolve_to_the_losss_own_defaults():
    batch = build_batch([[1, 2]], [[5]], [[0.0]], [1.0])
    ratio_1_25 = torch.full_like(batch.old_logprobs, torch.tensor(1.25).log().item())

    def clip_frac(cfg):
        return Algorithm(cfg, 1.0).objective(batch, None)(ratio_1_25, batch)[1][
            "actor/clip_frac"]
    assert clip_frac(AlgorithmConfig(loss="dapo")) == 0.0                   # 1.25 < 1 + 0.28
    assert clip_frac(AlgorithmConfig(loss="dapo", clip_high=0.2)) == 1.0
    assert clip_frac(AlgorithmConfig(loss="grpo")) == 1.0                   # 1.25 > 1 + 0.2
    assert Algorithm(AlgorithmConfig(loss="dapo"), 1.0).aggregation == "token-mean"
    assert Algorithm(AlgorithmConfig(), 1.0).aggregation == "seq-mean-token-mean"
