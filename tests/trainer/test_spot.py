"""SpotTrainer: preemptible micro-steps, versioned and checksummed publishing, a resumed
trainer that continues exactly (the Ray actor that serves it: tests/cluster/)."""

from __future__ import annotations

import io
import random
import threading
import time

import pytest
import torch

from fastdraft.databuffer import DataBuffer, Sample
from fastdraft.drafter import build_drafter
from fastdraft.models import load_model
from fastdraft.trainer.spot import (
    MAX_LATENCIES,
    PolicyHead,
    SpotConfig,
    SpotTrainer,
    StopEvent,
)
from fastdraft.utils.digest import tensor_digest


def _samples(policy, n: int, step: int = 0) -> list[Sample]:
    rng = random.Random(step)
    out = []
    for i in range(n):
        ids = torch.tensor([rng.randrange(3, 64) for _ in range(rng.randrange(6, 20))])
        with torch.no_grad():
            _, hidden = policy(ids.unsqueeze(0), torch.arange(len(ids)).unsqueeze(0))
        out.append(Sample(request_index=i, policy_version=0, rl_step=step, token_ids=ids,
                          positions=torch.arange(len(ids)), hidden=hidden.final[0],
                          loss_mask=torch.ones(len(ids), dtype=torch.bool), reward=1.0))
    return out


def _setup(tiny_checkpoint):
    policy = load_model(tiny_checkpoint[0]).eval()
    torch.manual_seed(0)
    drafter = build_drafter("eagle1", policy.config, 128)
    return policy, drafter


def test_run_returns_within_one_micro_step_of_stop_and_publishes_checksummed(tiny_checkpoint):
    policy, drafter = _setup(tiny_checkpoint)
    buffer = DataBuffer(2**24)
    for s in _samples(policy, 16):
        buffer.add(s)
    trainer = SpotTrainer(drafter, PolicyHead.of(policy), buffer, SpotConfig(token_budget=64))
    before = trainer.publish()
    assert trainer.run(threading.Event(), max_steps=3) == 3
    stop = StopEvent()
    thread = threading.Thread(target=trainer.run, args=(stop,))
    thread.start()
    time.sleep(0.3)
    steps_before_stop = trainer.stats.steps
    stop.set()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert trainer.stats.steps <= steps_before_stop + 1     # at most the micro-step under way
    assert trainer.stats.preemptions == 1 and trainer.stats.preemption_latencies_s[0] < 5
    after = trainer.publish()
    assert (before.version, after.version) == (1, 2)
    assert after.checksum == tensor_digest(after.tensors) != before.checksum
    assert {n for n, _ in after.tensors} == {n for n, _ in drafter.named_parameters()}
    assert trainer.stats.last["top1_acc"] <= trainer.stats.last["top3_acc"]


def test_a_run_of_days_keeps_the_recent_preemption_latencies(tiny_checkpoint):
    """The stats cross to the loop at every publish: they must not grow with the run."""
    policy, drafter = _setup(tiny_checkpoint)
    trainer = SpotTrainer(drafter, PolicyHead.of(policy), DataBuffer(1024))
    for _ in range(MAX_LATENCIES + 50):
        trainer.record_preemption(time.perf_counter())
    assert trainer.stats.preemptions == MAX_LATENCIES + 50
    assert len(trainer.stats.preemption_latencies_s) == MAX_LATENCIES


def test_an_empty_buffer_ends_run_at_once(tiny_checkpoint):
    policy, drafter = _setup(tiny_checkpoint)
    trainer = SpotTrainer(drafter, PolicyHead.of(policy), DataBuffer(1024))
    assert trainer.run(threading.Event()) == 0 and trainer.stats.preemptions == 0


def train_until(trainer, samples: list[Sample], steps: int, timeout_s: float = 60.0) -> None:
    """Sends `samples` to a trainer in another process (a TrainerHandle), tells it to train
    and waits until it has taken `steps` micro-steps."""
    for s in samples:
        trainer.add(s)
    trainer.go()
    deadline = time.monotonic() + timeout_s
    while trainer.publish().version and trainer.stats.steps < steps:
        assert time.monotonic() < deadline, "the trainer did not train"
        time.sleep(0.2)


def test_a_trainer_resumed_from_its_state_continues_exactly(tiny_checkpoint):
    """Weights, optimizer moments, counters and the buffer's sampling RNG come back: the
    resumed trainer draws the same batches and reaches the same weights as one never stopped."""
    policy, drafter = _setup(tiny_checkpoint)

    def trainer(d):
        buffer = DataBuffer(2**24, seed=0)
        for s in _samples(policy, 16):
            buffer.add(s)
        return SpotTrainer(d, PolicyHead.of(policy), buffer, SpotConfig(token_budget=48))
    first = trainer(drafter)
    for _ in range(3):
        first.step()
    first.record_preemption(time.perf_counter())
    state = _through_bytes(first.state())   # as it crosses to the checkpoint
    torch.manual_seed(1)
    resumed = trainer(build_drafter("eagle1", policy.config, 128))   # other initial weights
    resumed.load_state(state)
    losses = [], []
    for _ in range(4):
        for t, out in zip((first, resumed), losses):
            assert t.step()
            out.append(t.stats.last["loss"])
    assert losses[0] == losses[1]
    assert tensor_digest(first.publish().tensors) == tensor_digest(resumed.publish().tensors)
    assert (resumed.stats.steps, resumed.stats.preemptions, resumed.version) == (7, 1, 1)


def test_an_fp32_drafter_trains_on_a_bf16_served_policy(tiny_checkpoint):
    """The engine serves bf16 (model.dtype) while the drafter trains in fp32: the hidden states
    and the policy head it is sent are bf16, and the trainer casts them to the drafter's dtype."""
    policy, drafter = _setup(tiny_checkpoint)
    buffer = DataBuffer(2**24)
    for s in _samples(policy.to(torch.bfloat16), 8):
        buffer.add(s)
    head = PolicyHead.of(policy)
    assert head.lm_head.weight.dtype == torch.bfloat16
    trainer = SpotTrainer(drafter, head, buffer, SpotConfig(token_budget=64))
    before = [p.detach().clone() for p in trainer.drafter.parameters()]
    assert trainer.run(threading.Event(), max_steps=2) == 2
    assert all(p.dtype == torch.float32 for p in trainer.drafter.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.drafter.parameters()))
    assert torch.isfinite(torch.tensor(trainer.stats.last["loss"]))


def test_bf16_compute_keeps_fp32_masters_and_the_loss_of_fp32_within_bf16(tiny_checkpoint):
    """compute_dtype=bfloat16: the forward and backward under autocast, the masters, their
    gradients and AdamW in fp32; the first step's loss is fp32's within bf16's precision, and
    not bit for bit (the matmuls really ran in bf16)."""
    policy, drafter = _setup(tiny_checkpoint)
    losses = {}
    for dtype in ("float32", "bfloat16"):
        buffer = DataBuffer(2**24, seed=0)
        for s in _samples(policy, 8):
            buffer.add(s)
        torch.manual_seed(0)
        trainer = SpotTrainer(drafter, PolicyHead.of(policy), buffer,
                              SpotConfig(token_budget=64, compute_dtype=dtype))
        assert trainer.step()
        losses[dtype] = trainer.stats.last["loss"]
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
                   for p in trainer.drafter.parameters() if p.grad is not None)
        assert all(v.dtype == torch.float32 for st in trainer.optimizer.state.values()
                   for v in st.values() if torch.is_tensor(v) and v.dim())
    assert losses["bfloat16"] != losses["float32"]
    assert abs(losses["bfloat16"] - losses["float32"]) < 0.02 * abs(losses["float32"])
    with pytest.raises(ValueError, match="float32 or bfloat16"):   # a FastdraftError
        SpotConfig(compute_dtype="float16")


def test_the_learning_rate_warms_up_over_micro_steps_and_a_resumed_trainer_keeps_the_ramp(
        tiny_checkpoint):
    """A fresh AdamW's first step moves every weight by ~lr (one gradient's m / sqrt(v) is its
    sign): with lr_warmup_steps it moves them by lr / warmup instead, reaching lr at the
    warmup's last micro-step; the ramp counts the run's micro-steps, so a trainer resumed
    from its state goes on where it stopped rather than warming up again."""
    policy, drafter = _setup(tiny_checkpoint)
    lr = 1e-2

    def trainer(d, warmup: int) -> SpotTrainer:
        buffer = DataBuffer(2**24, seed=0)
        for s in _samples(policy, 16):
            buffer.add(s)
        return SpotTrainer(d, PolicyHead.of(policy), buffer,
                           SpotConfig(token_budget=48, lr=lr, lr_warmup_steps=warmup))

    def first_move(warmup: int) -> float:
        t = trainer(build_drafter("eagle1", policy.config, 128), warmup)
        before = [p.detach().clone() for p in t.drafter.parameters()]
        assert t.step()
        return max((p - b).abs().max().item() for p, b in zip(t.drafter.parameters(), before))
    torch.manual_seed(0)
    assert abs(first_move(0) - lr) < 1e-3 * lr
    torch.manual_seed(0)
    assert abs(first_move(4) - lr / 4) < 1e-3 * lr

    ramp = trainer(drafter, 4)
    lrs = []
    for _ in range(2):
        ramp.step()
        lrs.append(ramp.optimizer.param_groups[0]["lr"])
    resumed = trainer(build_drafter("eagle1", policy.config, 128), 4)
    resumed.load_state(ramp.state())
    for _ in range(3):
        resumed.step()
        lrs.append(resumed.optimizer.param_groups[0]["lr"])
    assert lrs == [lr * k / 4 for k in (1, 2, 3, 4, 4)]


def test_a_cuda_trainer_on_a_machine_without_one_is_refused_with_the_setting_to_change():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=r"set drafter\.online\.device=cpu"):
        SpotConfig(device="cuda")
    with pytest.raises(ValueError, match="lr_warmup_steps must be >= 0"):
        SpotConfig(lr_warmup_steps=-1)


def test_a_trained_drafter_is_published_only_if_it_beats_the_serving_one_on_held_out_rollouts(
        tiny_checkpoint):
    policy, drafter = _setup(tiny_checkpoint)   # a random drafter: training can only help
    buffer = DataBuffer(2**24, holdout_every=4)
    for s in _samples(policy, 32):
        buffer.add(s)
    trainer = SpotTrainer(drafter, PolicyHead.of(policy), buffer, SpotConfig(token_budget=128,
                                                                            lr=3e-3))
    first = trainer.publish()   # nothing trained yet: the serving drafter itself, a tie
    assert first.check.candidate == pytest.approx(first.check.serving)
    assert first.check.chains == sum(s.num_tokens - 1 for s in _samples(policy, 32)
                                     if buffer.is_held_out(s.key))
    assert trainer.run(threading.Event(), max_steps=40) == 40
    trained = trainer.publish()
    assert not trained.withheld and trained.version == 2
    assert trained.check.candidate > trained.check.serving
    assert [t for _, t in trained.tensors] == trainer.serving   # what it is judged against now
    # A step that damages the drafter (say, the policy moved and the trainer chased noise):
    with torch.no_grad():
        for p in trainer.drafter.parameters():
            p.add_(torch.randn_like(p))
    damaged = trainer.publish()
    assert damaged.withheld and damaged.tensors == [] and damaged.version == 2
    assert damaged.check.candidate < damaged.check.serving == pytest.approx(
        trained.check.candidate, rel=1e-5)
    # Without held-out rollouts nothing is checked: every publish goes out.
    plain = SpotTrainer(drafter, PolicyHead.of(policy), DataBuffer(2**24), SpotConfig())
    assert plain.publish().check is None


def _through_bytes(tree: dict) -> dict:
    """A state tree saved and loaded again (torch.save: what a checkpoint writes)."""
    buf = io.BytesIO()
    torch.save(tree, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)
