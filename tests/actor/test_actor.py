"""The actor trains the same model the engine runs; weights cross by name, never by aliasing;
fp32 masters with compute in actor.compute_dtype; micro-batching never changes the gradient."""

from __future__ import annotations

import functools
import weakref

import pytest
import torch

from fastdraft import RolloutEngine, SamplingParams
from fastdraft.actor.rank import ActorSpec
from fastdraft.algo.logprobs import token_logprobs
from fastdraft.algo.sequences import build_batch, micro_batches, split_across_ranks
from fastdraft.config.sections import ActorConfig, AlgorithmConfig
from fastdraft.models import load_model
from fastdraft.workers.actor import Actor


def spec(path, **actor) -> ActorSpec:
    return ActorSpec(policy_dir=path, reference_dir=path,
                     actor=ActorConfig(**{"lr": 1e-2, **actor}),
                     algorithm=AlgorithmConfig(loss="grpo"), temperature=1.0, max_new_tokens=8,
                     max_positions=64, device="cpu", num_steps=4)


def rollout_batch(engine: RolloutEngine, advantages=(1.0, -0.5, 0.25)):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, seed=0, max_new_tokens=6,
                                                   ignore_eos=True))
    return build_batch(prompts, [o.token_ids for o in outs], [o.logprobs for o in outs],
                       list(advantages))


def synthetic_batch(rows: int = 10, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 60, (int(n),), generator=g).tolist()
               for n in torch.randint(2, 6, (rows,), generator=g)]
    answers = [torch.randint(3, 60, (int(n),), generator=g).tolist()
               for n in torch.randint(2, 14, (rows,), generator=g)]
    return build_batch(prompts, answers, [[-2.0] * len(a) for a in answers],
                       torch.randn(rows, generator=g).tolist())


def first_moments(actor: Actor) -> dict[str, torch.Tensor]:
    """AdamW's exp_avg after one step from zero is (1 - beta1) x the clipped gradient."""
    with actor.full_state() as (_, training):   # (the weights' gather: done on exit)
        return {n: s["exp_avg"].clone() for n, s in training["optimizer"]["state"].items()}


def test_an_update_then_a_push_gives_the_engine_exactly_the_actors_weights(tiny_checkpoint):
    path, _ = tiny_checkpoint
    actor = Actor(spec(path))
    engine = RolloutEngine(path, max_batch_size=4, max_seq_len=32)
    q_before = actor.ranks.rank0.model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    result = actor.update(rollout_batch(engine))
    assert result.applied and actor.step == 1   # one optimizer step per update
    q_after = actor.ranks.rank0.model.model.layers[0].self_attn.q_proj.weight
    assert q_after.is_leaf and not torch.equal(q_after, q_before)  # the engine did not steal it
    assert engine.load_weights(actor.full_parameters()) == 1
    mine = dict(actor.ranks.rank0.model.named_parameters())
    for name, param in engine.model.named_parameters():
        assert torch.equal(param, mine[name]), name
    # ... so the engine's logprobs of a rollout are the actor's (up to fp32 rounding)
    batch = rollout_batch(engine)
    actor_lp = actor.logprobs(batch)
    assert (actor_lp - batch.old_logprobs).abs()[batch.mask].max() < 1e-4


def test_micro_batching_does_not_change_the_gradient(tiny_checkpoint):
    path, _ = tiny_checkpoint
    batch = synthetic_batch()
    moments = []
    # one micro-batch vs many; packed (the default) and padded rows; logits in chunks of 4
    for budget, packed, chunk in ((10_000, True, 4096), (24, True, 4), (24, False, 0)):
        actor = Actor(spec(path, micro_batch_tokens=budget, pack_sequences=packed,
                           logits_chunk_tokens=chunk))
        assert actor.update(batch).applied
        moments.append(first_moments(actor))
    assert len(micro_batches(batch, 24)) > 3 and len(micro_batches(batch, 24, packed=True)) > 3
    for other in moments[1:]:
        for name, value in moments[0].items():
            torch.testing.assert_close(other[name], value, rtol=1e-4, atol=1e-7)


def test_the_ranks_share_the_micro_batches_and_pad_to_the_same_count():
    batch = synthetic_batch(rows=7)
    plan = split_across_ranks(batch, max_tokens=24, num_ranks=3)
    assert len({len(p) for p in plan}) == 1      # every rank the same number of passes
    rows = sorted(int(r) for p in plan for mb in p if mb is not None for r in mb)
    assert rows == list(range(7))                # every row exactly once


def test_a_nan_loss_skips_the_step(tiny_checkpoint, monkeypatch):
    path, _ = tiny_checkpoint
    actor = Actor(spec(path))
    before = [p.detach().clone() for p in actor.ranks.rank0.model.parameters()]
    monkeypatch.setattr(actor.ranks.rank0.algorithm, "objective", lambda *a, **k: (
        lambda logprobs, mb: (logprobs.sum() * float("nan"), {})))
    result = actor.update(synthetic_batch())
    assert not result.applied and result.metrics["actor/skipped"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, actor.ranks.rank0.model.parameters()))


def test_a_refusing_gate_leaves_the_weights_untouched(tiny_checkpoint):
    path, _ = tiny_checkpoint
    actor = Actor(spec(path))
    before = [p.detach().clone() for p in actor.ranks.rank0.model.parameters()]

    def refuse(_):
        raise ValueError("gate")
    with pytest.raises(ValueError, match="gate"):
        actor.update(synthetic_batch(), before_step=refuse)
    assert all(torch.equal(a, b) for a, b in zip(before, actor.ranks.rank0.model.parameters()))
    assert all(p.grad is None for p in actor.ranks.rank0.model.parameters())
    assert actor.update(synthetic_batch()).applied   # and the next update is a clean one


def test_bf16_compute_keeps_fp32_masters_that_learn_at_a_small_lr(tiny_checkpoint):
    """The old actor ran AdamW on bf16 weights: at lr 1e-6 an update is below bf16's spacing,
    so 98% of the weights never moved. The masters are fp32 and compute is bf16."""
    path, _ = tiny_checkpoint
    actor = Actor(spec(path, lr=1e-6, compute_dtype="bfloat16"))
    start = {n: t.clone() for n, t in actor.full_parameters()}
    assert all(t.dtype == torch.float32 for t in start.values())
    for step in range(10):
        assert actor.update(synthetic_batch(seed=step)).applied
    end = dict(actor.full_parameters())
    changed = sum(int((end[n] != start[n]).sum()) for n in start)
    total = sum(t.numel() for t in start.values())
    assert changed / total > 0.9
    # the compute is bf16: the actor's logprobs differ from an fp32 forward by bf16 rounding
    batch = synthetic_batch()
    with torch.no_grad():
        fp32 = token_logprobs(load_model(path), batch.input_ids, 1.0)
    diff = (actor.logprobs(batch) - fp32).abs()[batch.mask]
    assert 1e-4 < float(diff.max()) < 0.5


def test_fp16_skips_overflowing_steps_shrinks_the_scale_and_goes_on(tiny_checkpoint):
    path, _ = tiny_checkpoint
    actor = Actor(spec(path, compute_dtype="float16", lr=1e-3))
    batch = synthetic_batch()
    first = actor.update(batch)
    assert first.applied
    scale = first.metrics["actor/loss_scale"]
    huge = synthetic_batch()
    huge.advantages.mul_(1e30)   # an overflow in the scaled fp16 backward
    overflow = actor.update(huge)
    assert not overflow.applied and overflow.metrics["actor/skipped"] == 1.0
    after = actor.update(batch)
    assert after.applied
    assert after.metrics["actor/loss_scale"] == scale / 2   # the skipped step halved it


def test_the_lr_schedule_counts_optimizer_steps(tiny_checkpoint):
    path, _ = tiny_checkpoint
    actor = Actor(spec(path, warmup_steps=4, updates_per_step=2))
    lrs = [actor.update(synthetic_batch()).metrics["actor/lr"] for _ in range(4)]
    assert lrs == pytest.approx([1e-2 * k / 4 for k in (1, 2, 3, 4)])
    assert actor.spec.total_optimizer_steps == 8


@pytest.mark.usefixtures("local_ray")   # ranks 1.. are Ray actors
def test_the_weight_push_gathers_one_parameter_at_a_time(tiny_checkpoint):
    path, _ = tiny_checkpoint
    actor = Actor(spec(path, num_ranks=2, compute_dtype="bfloat16"))
    try:
        previous = None
        count = 0
        for _, tensor in actor.full_parameters():
            assert tensor.dtype == torch.float32   # the masters, whole
            if previous is not None:
                assert previous() is None, "the last gathered tensor is still alive"
            previous = weakref.ref(tensor)
            del tensor
            count += 1
        assert count == len(list(load_model(path).parameters()))
    finally:
        actor.close()


@pytest.mark.usefixtures("local_ray")   # ranks 1.. are Ray actors
def test_two_ranks_give_the_one_rank_gradient_gate_logprobs_and_weights(tiny_checkpoint):
    """FSDP2 over 2 processes (gloo): the same gradient (through AdamW's first moment), the
    same logprobs for the gate, one optimizer step, and a gathered push that the engine runs."""
    path, _ = tiny_checkpoint
    batch = synthetic_batch(rows=11)
    results = {}
    for ranks in (1, 2):
        actor = Actor(spec(path, num_ranks=ranks, micro_batch_tokens=30,
                           compute_dtype="bfloat16"))
        try:
            seen: dict[str, torch.Tensor] = {}
            update = actor.update(batch, before_step=lambda lp, box=seen: box.setdefault("lp", lp))
            assert update.applied and actor.step == 1
            engine = RolloutEngine(path, max_batch_size=4, max_seq_len=32,
                                   dtype=torch.bfloat16)
            engine.load_weights(actor.full_parameters())
            masters = dict(actor.full_parameters())
            for name, param in engine.model.named_parameters():   # bf16 casts of the masters
                assert torch.equal(param, masters[name].to(torch.bfloat16)), name
            results[ranks] = (first_moments(actor), seen["lp"], update.metrics)
        finally:
            actor.close()
    (m1, lp1, met1), (m2, lp2, met2) = results[1], results[2]
    for name in m1:
        torch.testing.assert_close(m2[name], m1[name], rtol=1e-3, atol=1e-6)
    for field in ("logprob", "entropy", "variance"):   # what the gate reads, whole batch
        one, two = getattr(lp1, field), getattr(lp2, field)
        assert bool((one[batch.mask] != 0).any())
        torch.testing.assert_close(two[batch.mask], one[batch.mask])
    assert met2["actor/grad_norm"] == pytest.approx(met1["actor/grad_norm"], rel=1e-4)
    assert met2["actor/loss"] == pytest.approx(met1["actor/loss"], rel=1e-5)


@pytest.mark.usefixtures("local_ray")   # ranks 1.. are Ray actors
@pytest.mark.parametrize("ranks", [1, 2])
def test_activation_checkpointing_gives_the_same_gradient(tiny_checkpoint, ranks):
    """Each layer recomputed in the backward (FSDP2 re-gathers its weights there): the same
    first moment (gradient) and logprobs as keeping every activation."""
    path, _ = tiny_checkpoint
    batch = synthetic_batch(rows=6)
    results = []
    for checkpointing in (False, True):
        actor = Actor(spec(path, num_ranks=ranks, compute_dtype="bfloat16",
                           activation_checkpointing=checkpointing))
        try:
            if checkpointing:   # the layers really run under torch.utils.checkpoint
                layer = actor.ranks.rank0.model.model.layers[0]
                assert isinstance(layer.forward, functools.partial)
            box: dict = {}
            assert actor.update(batch, before_step=lambda s, b=box: b.setdefault("s", s)).applied
            results.append((first_moments(actor), box["s"].logprob))
        finally:
            actor.close()
    (m0, lp0), (m1, lp1) = results
    torch.testing.assert_close(lp1[batch.mask], lp0[batch.mask])
    for name in m0:
        torch.testing.assert_close(m1[name], m0[name], rtol=1e-3, atol=1e-7)


@pytest.mark.usefixtures("local_ray")   # ranks 1.. are Ray actors
def test_rank_0_here_listens_at_the_address_ray_gives_this_node(tiny_checkpoint, monkeypatch):
    """Several ranks with rank 0 in this process rendezvous at this node's address as Ray
    names it (on a cluster: an IP the other nodes reach), never a fixed 127.0.0.1: here Ray is
    made to name 127.0.0.2 (loopback too), and both ranks meet there and update."""
    import ray
    path, _ = tiny_checkpoint
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.2")
    actor = Actor(spec(path, num_ranks=2, compute_dtype="bfloat16"))
    try:
        assert actor.update(synthetic_batch(rows=4)).applied
        follower = actor.ranks.peers.ranks[0]
        assert ray.get(follower.__ray_call__.remote(
            lambda self: self.actor.spec.address)) == "127.0.0.2"
    finally:
        actor.close()
