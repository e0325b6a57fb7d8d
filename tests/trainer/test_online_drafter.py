"""Online drafter training in the GRPO loop: samples reach the worker, a new drafter version
is published into the engine every step (checksummed), the lossless gate still holds; a
collapsed drafter makes the engine fall back to plain decoding; a corrupted one is refused."""

from __future__ import annotations

import json

import pytest
import torch

from fastdraft import RolloutEngine, SamplingParams, SpecConfig
from fastdraft.drafter.checkpoint import trainable_named_tensors
from fastdraft.models import load_model
from fastdraft.observability.metrics import read_metrics
from fastdraft.run.loop import train, train_step
from fastdraft.run.run import Run
from tests.export.conftest import specforge_checkpoint
from tests.run.test_loop import _cfg
from tests.trainer.online_helpers import online_drafter

# One Ray cluster for the module: the trainers the tests start, and the runs (which join it).
pytestmark = pytest.mark.usefixtures("local_ray")


def test_the_drafter_trains_online_and_is_published_every_step(char_policy, char_drafter,
                                                               tmp_path):
    run = Run(_cfg(char_policy, "rollout.spec.method=eagle", f"drafter.path={char_drafter}",
                   "drafter.online.enabled=true", "drafter.online.token_budget=64",
                   "drafter.online.tail_fraction=1.0", "algorithm.num_steps=3",
                   "drafter.online.max_steps_per_step=8"),
              tmp_path / "run")
    train(run)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert sum(r["drafter/train_steps"] for r in rows) > 0
    assert all(r["rollout/logprob_diff_max"] < 1e-3 for r in rows)
    refreshed = [r for r in rows if r.get("drafter/refreshed")]
    assert refreshed and run.engine.drafter_version == len(refreshed)
    assert rows[-1]["drafter/version"] == len(refreshed) - (1 if rows[-1].get(
        "drafter/refreshed") else 0)
    for key in ("drafter/loss", "drafter/top1_acc", "drafter/train_tokens",
                "drafter/preemptions", "drafter/buffer_bytes", "drafter/worker_rss_mb",
                "process/rss_mb"):
        assert key in rows[-1], key
    assert 0 < rows[-1]["drafter/worker_rss_mb"] < rows[-1]["process/rss_mb"] * 10
    # The end of the run: the drafter saved, exported, and checked, for both engines.
    for engine in ("sglang", "vllm"):
        assert (tmp_path / "run" / "export" / engine / "config.json").is_file()
    trained = {n: t.clone() for n, t in trainable_named_tensors(run.engine.proposer.drafter)}
    # --resume puts the trained drafter (and its version) back into the engine.
    resumed = Run(_cfg(char_policy, "rollout.spec.method=eagle", f"drafter.path={char_drafter}",
                       "drafter.online.enabled=true", "algorithm.num_steps=4",
                       "drafter.online.token_budget=64", "drafter.online.tail_fraction=1.0",
                       "drafter.online.max_steps_per_step=8"),
                  tmp_path / "run", resume=True)
    assert resumed.engine.drafter_version == run.engine.drafter_version
    for name, tensor in trainable_named_tensors(resumed.engine.proposer.drafter):
        assert torch.equal(tensor, trained[name]), name
    # ... and the online trainer continues where it was: counters, version, optimizer moments.
    state = resumed.drafter.trainer_state()
    assert state["steps"] == sum(r["drafter/train_steps"] for r in rows)
    assert state["version"] == len(refreshed) and state["optimizer"]["state"]
    for name, tensor in state["drafter"].items():
        assert torch.equal(tensor, trained[name]), name
    # Its first step counts that step's micro-steps (at most the cap), not the run's, and the
    # preemption count goes on from the checkpoint's.
    step3 = train_step(resumed, 3)
    assert 0 < step3["drafter/train_steps"] <= 8
    assert step3["drafter/preemptions"] > rows[-1]["drafter/preemptions"]
    assert step3["drafter/train_tokens"] > rows[-1]["drafter/train_tokens"]
    resumed.finish()
    # `fastdraft export` does it again from the run directory.
    from fastdraft.cli import main
    assert main(["export", "--run", str(tmp_path / "run"), "--format", "vllm",
                 "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "vllm" / "config.json").is_file()


def _eagle_engine(path, drafter):
    return RolloutEngine(path, max_batch_size=4, max_seq_len=64, drafter=drafter,
                         spec=SpecConfig(method="eagle", depth=3, topk=2, tokens_to_verify=4))



def test_after_a_resume_per_step_counters_stay_per_step_and_totals_continue(
        char_policy, char_drafter, tmp_path):
    """drafter/train_steps counts this step's micro-steps (within the cap) on the first step
    after a resume too; drafter/preemptions and train_tokens are run totals: they continue from
    the checkpoint, they do not restart."""
    online = [f"drafter.path={char_drafter}", "rollout.spec.method=eagle",
              "drafter.online.enabled=true", "drafter.online.token_budget=64",
              "drafter.online.tail_fraction=1.0", "drafter.online.max_steps_per_step=3",
              "drafter.export=false", "logging.dashboard=false"]
    train(Run(_cfg(char_policy, *online, "algorithm.num_steps=3"), tmp_path / "run"))
    train(Run(_cfg(char_policy, *online, "algorithm.num_steps=5"), tmp_path / "run",
              resume=True))
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert all(r["drafter/train_steps"] <= 3 for r in rows)
    # (the buffer's samples are not checkpointed: as at step 0, the first step after the resume
    # fills it and the next one trains on it)
    assert rows[4]["drafter/train_steps"] > 0
    for key in ("drafter/preemptions", "drafter/train_tokens"):
        totals = [r[key] for r in rows]
        assert totals == sorted(totals) and totals[4] > totals[2] > 0, (key, totals)

def test_a_collapsed_drafter_falls_back_to_plain_decoding(char_policy, char_drafter):
    from fastdraft.config.sections import OnlineDrafterConfig
    engine = _eagle_engine(char_policy, char_drafter)
    online = online_drafter(OnlineDrafterConfig(enabled=True), engine)
    try:
        for accept in (1.1, 1.0, 1.05):
            metrics = online.after_step(engine, accept)
    finally:
        online.close()
    assert metrics["drafter/fallback"] == 1.0
    assert engine.spec.method == "none" and "accept length" in engine.fallback_reason
    out = engine.generate([[5, 6, 7]], SamplingParams(greedy=True, max_new_tokens=5))
    plain = RolloutEngine(char_policy, max_seq_len=64).generate(
        [[5, 6, 7]], SamplingParams(greedy=True, max_new_tokens=5))
    assert out[0].token_ids == plain[0].token_ids and out[0].spec is None


def test_a_drafter_whose_checksum_does_not_match_is_not_loaded(char_policy, char_drafter):
    from fastdraft.utils.digest import tensor_digest
    engine = _eagle_engine(char_policy, char_drafter)
    tensors = [(n, t.clone()) for n, t in trainable_named_tensors(engine.proposer.drafter)]
    good = tensor_digest(tensors)
    corrupted = [(n, t + 1.0) for n, t in tensors]
    with pytest.raises(ValueError, match="checksum"):
        engine.load_drafter_weights(corrupted, version=1, checksum=good)
    assert engine.drafter_version == 0
    assert tensor_digest(trainable_named_tensors(engine.proposer.drafter)) == good
    assert engine.load_drafter_weights(tensors, version=1, checksum=good) == 1


def test_the_health_check_keeps_only_its_window(char_policy, char_drafter):
    """A healthy drafter over thousands of steps: no fallback, and the history stays bounded."""
    from fastdraft.trainer.drafter_health import HEALTH_WINDOW, health_check
    engine = _eagle_engine(char_policy, char_drafter)
    history: list[float] = []
    for step in range(5000):
        assert not health_check(engine, history, 3.0 + step % 2)
    assert len(history) == HEALTH_WINDOW and engine.spec.method == "eagle"
    for _ in range(HEALTH_WINDOW):   # then it collapses: detected within the window
        fell_back = health_check(engine, history, 1.0)
    assert fell_back and engine.spec.method == "none"


def test_an_eagle3_drafter_trains_online_in_an_rl_run(char_policy, char_eagle3, tmp_path):
    """The engine captures the aux layers the trainer's EAGLE-3 drafter reads, the online loss
    follows the drafter's kind, and the drafter's version rises every step (its trainer
    computing in bf16 over fp32 masters, as on a GPU)."""
    run = Run(_cfg(char_policy, "rollout.spec.method=eagle", f"drafter.path={char_eagle3}",
                   "drafter.online.enabled=true", "drafter.online.token_budget=64",
                   "drafter.online.compute_dtype=bfloat16",
                   "drafter.online.tail_fraction=1.0", "algorithm.num_steps=3",
                   "drafter.online.min_steps_per_step=2", "drafter.export=false"),
              tmp_path / "run")
    try:
        aux = run.engine.model_drafter.aux_layers
        assert len(aux) == 3 and run.engine.capture_aux_layers == aux
        assert run.drafter.loss == "eagle3" and run.drafter.spot.compute_dtype == "bfloat16"
        versions = []
        for step in range(3):
            metrics = train_step(run, step)
            # at least the minimum, however little idle time this busy machine left
            assert metrics["drafter/train_steps"] >= 2 and "drafter/top1_acc" in metrics
            assert metrics["drafter/worker_failures"] == 0
            versions.append(run.engine.drafter_version)
    finally:
        run.finish()
    assert versions == [1, 2, 3]
    rows = read_metrics(tmp_path / "run")
    assert all(0 <= r["drafter/top1_acc"] <= 1 for r in rows)
    assert all(r["rollout/logprob_diff_max"] < 1e-3 for r in rows)


def test_an_imported_specforge_drafter_serves_and_trains_online(char_policy, tmp_path):
    """drafter.path at a SpecForge checkpoint (own lm_head over a draft vocabulary, aux layers
    named in SGLang's count): the run imports it into its run directory, serves it losslessly,
    trains its own lm_head online and publishes it, and exports both layouts at its end."""
    vocab = load_model(char_policy).config.vocab_size
    src = specforge_checkpoint(tmp_path / "specforge", vocab=vocab, draft_vocab=vocab // 2,
                               sglang_aux_ids=[0, 0, 0], max_positions=512)
    run = Run(_cfg(char_policy, "rollout.spec.method=eagle", f"drafter.path={src}",
                   "drafter.online.enabled=true", "drafter.online.token_budget=64",
                   "drafter.online.tail_fraction=1.0", "algorithm.num_steps=2",
                   "drafter.online.min_steps_per_step=2"),
              tmp_path / "run")
    drafter = run.engine.model_drafter
    assert drafter.aux_layers == (1, 1, 1) and drafter.head.out_features == vocab // 2
    head = drafter.head.weight.detach().clone()
    train(run)
    rows = read_metrics(tmp_path / "run")
    assert all(r["rollout/logprob_diff_max"] < 1e-3 for r in rows)
    assert sum(r["drafter/train_steps"] for r in rows) >= 4 and run.engine.drafter_version >= 1
    assert not torch.equal(run.engine.model_drafter.head.weight, head)   # published, trained
    for layout in ("sglang", "speculators"):
        assert (tmp_path / "run" / "export" / layout / "config.json").is_file()
    # `fastdraft export` again, vLLM's layout only, with the draft length vLLM serves
    from fastdraft.cli import main
    assert main(["export", "--run", str(tmp_path / "run"), "--format", "speculators",
                 "--speculative-tokens", "5", "--out", str(tmp_path / "again")]) == 0
    config = json.loads((tmp_path / "again" / "speculators" / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 1, 1]
    assert config["draft_vocab_size"] == vocab // 2


def test_the_online_loss_and_device_follow_the_drafter_and_the_policy(char_policy,
                                                                       char_eagle3):
    from fastdraft.config.sections import OnlineDrafterConfig
    engine = _eagle_engine(char_policy, char_eagle3)
    with pytest.raises(ValueError, match=r"loss=eagle1 trains an eagle1 drafter"):
        online_drafter(OnlineDrafterConfig(enabled=True, loss="eagle1"), engine)
    for loss, want in ((None, "eagle3"), ("reward_kd", "reward_kd")):
        online = online_drafter(OnlineDrafterConfig(enabled=True, loss=loss), engine)
        online.close()
        assert (online.loss, online.spot.loss) == (want, want)
        assert online.device == online.spot.device == "cpu"   # the policy's device
    online = online_drafter(OnlineDrafterConfig(enabled=True, lr=2e-4, lr_warmup_steps=24), engine)
    online.close()
    assert (online.spot.lr, online.spot.lr_warmup_steps) == (2e-4, 24)   # the recipe's ramp
    assert online.spot.compute_dtype == "float32"   # on a CPU by default; bf16 on a GPU
    online = online_drafter(OnlineDrafterConfig(enabled=True, compute_dtype="bfloat16"), engine)
    online.close()
    assert online.spot.compute_dtype == "bfloat16"
    with pytest.raises(ValueError, match=r"compute_dtype must be float32, bfloat16 or null"):
        OnlineDrafterConfig(enabled=True, compute_dtype="float16")
    if not torch.cuda.is_available():   # never a silent fallback to the host's cores
        with pytest.raises(ValueError, match="no CUDA device"):
            online_drafter(OnlineDrafterConfig(enabled=True, device="cuda"), engine)



def test_a_drafter_that_loses_on_the_held_out_rollouts_is_withheld(char_policy, char_drafter):
    """What the loop does with the trainer's verdict (the verdict itself: tests/trainer/
    test_spot.py): a withheld drafter leaves the engine's in place, is no failure, and the
    next one that wins is published."""
    from fastdraft.config.sections import OnlineDrafterConfig
    from fastdraft.trainer.spot import HeldOutCheck, Published
    from tests.trainer.online_helpers import drive_step, eagle_engine
    engine = eagle_engine(char_policy, char_drafter)
    online = online_drafter(OnlineDrafterConfig(enabled=True, token_budget=64, tail_fraction=1.0,
                                               holdout_every=2, min_steps_per_step=2), engine)
    try:
        metrics = drive_step(online, engine, 0)
        assert metrics["drafter/held_out_accept"] > 1.0 and "drafter/withheld" in metrics
        version = engine.drafter_version
        serving = {n: t.clone() for n, t in trainable_named_tensors(engine.model_drafter)}
        real_publish = online.worker.publish
        online.worker.publish = lambda min_steps=0: Published(version, "", [],
                                                              HeldOutCheck(1.5, 2.0, 40))
        metrics = online.after_step(engine, 3.0)
        assert metrics["drafter/withheld"] == 1.0 and "drafter/refreshed" not in metrics
        assert (metrics["drafter/held_out_accept"],
                metrics["drafter/held_out_serving_accept"]) == (1.5, 2.0)
        assert metrics["drafter/rejected"] == 0 and metrics["drafter/restarts"] == 0
        assert engine.drafter_version == version
        for name, tensor in trainable_named_tensors(engine.model_drafter):
            assert torch.equal(tensor, serving[name]), name
        online.worker.publish = real_publish
        metrics = drive_step(online, engine, 1)
        if not metrics["drafter/withheld"]:
            assert metrics["drafter/refreshed"] and engine.drafter_version == version + 1
    finally:
        online.close()
