"""The actor trains the same model the engine runs; weights cross by name, never by aliasing."""

from __future__ import annotations

import torch

from fastdraft import RolloutEngine, SamplingParams
from fastdraft.config.sections import ActorConfig
from fastdraft.models import load_model
from fastdraft.rl.actor import Actor, token_logprobs
from fastdraft.rl.sequences import build_batch, micro_batches


def _batch(engine: RolloutEngine):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, seed=0, max_new_tokens=6,
                                                   ignore_eos=True))
    return build_batch(prompts, [o.token_ids for o in outs], [o.logprobs for o in outs],
                       [1.0, -0.5, 0.25])


def _objective(logprobs, mb):
    loss = -(logprobs * mb.mask * mb.advantages[:, None]).sum() / 18
    return loss, {"actor/loss": float(loss.detach())}


def test_an_update_then_a_push_gives_the_engine_exactly_the_actors_weights(tiny_checkpoint):
    path, _ = tiny_checkpoint
    policy = load_model(path)
    actor = Actor(policy, ActorConfig(lr=1e-2), total_steps=4)   # optimizer first ...
    engine = RolloutEngine.from_model(policy, max_batch_size=4, max_seq_len=32)  # ... engine next
    q_before = policy.model.layers[0].self_attn.q_proj.weight.detach().clone()
    batch = _batch(engine)
    result = actor.update(batch, _objective, temperature=1.0)
    assert result.applied
    q_after = policy.model.layers[0].self_attn.q_proj.weight
    assert q_after.is_leaf and not torch.equal(q_after, q_before)  # the engine did not steal it
    assert engine.load_weights(actor.named_parameters()) == 1
    mine = dict(actor.named_parameters())
    for name, param in engine.model.named_parameters():
        assert torch.equal(param, mine[name]), name
    # ... so the engine's logprobs of a rollout are the actor's (up to fp32 rounding)
    batch = _batch(engine)
    actor_lp = actor.logprobs(batch, temperature=1.0)
    assert (actor_lp - batch.old_logprobs).abs()[batch.mask].max() < 1e-4


def test_micro_batching_does_not_change_the_gradient(tiny_checkpoint):
    path, _ = tiny_checkpoint
    engine = RolloutEngine(path, max_batch_size=4, max_seq_len=32)
    batch = _batch(engine)
    grads = []
    for budget in (10_000, 12):  # one micro-batch vs one per row
        assert len(micro_batches(batch, budget)) == (1 if budget > 100 else 3)
        model = load_model(path)
        actor = Actor(model, ActorConfig(lr=1e-3, micro_batch_tokens=budget), total_steps=1)
        actor.optimizer.step = lambda: None  # keep the gradient to compare it
        actor.optimizer.zero_grad = lambda set_to_none=True: None
        actor.update(batch, _objective, temperature=1.0)
        grads.append(model.lm_head.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


def test_a_nan_loss_skips_the_step(tiny_checkpoint):
    path, _ = tiny_checkpoint
    model = load_model(path)
    actor = Actor(model, ActorConfig(lr=1e-2), total_steps=2)
    before = [p.detach().clone() for p in model.parameters()]
    engine = RolloutEngine(path, max_batch_size=4, max_seq_len=32)
    result = actor.update(_batch(engine), lambda lp, mb: (lp.sum() * float("nan"), {}), 1.0)
    assert not result.applied and result.metrics["actor/skipped"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_token_logprobs_score_each_next_token():
    class Fixed(torch.nn.Module):
        def forward(self, input_ids, positions):
            logits = torch.zeros(1, 3, 8)
            logits[0, 0, 4] = 2.0   # position 0 predicts token 4
            logits[0, 1, 5] = 1.0   # position 1 predicts token 5
            return logits, None
    lp = token_logprobs(Fixed(), torch.tensor([[3, 4, 5]]), temperature=2.0)
    z0 = torch.logsumexp(torch.tensor([1.0] + [0.0] * 7), 0)   # logits / T
    z1 = torch.logsumexp(torch.tensor([0.5] + [0.0] * 7), 0)
    torch.testing.assert_close(lp, torch.tensor([[1.0 - z0, 0.5 - z1]]))
