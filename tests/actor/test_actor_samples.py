"""The online drafter's samples from the actor's forward (drafter.online.source=actor) are the
engine capture's samples: the same tokens, positions and loss masks, hidden states equal up to
the forward's numerics; a run that takes them trains and publishes its drafter every step."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from fastdraft import RolloutEngine, SamplingParams, SpecConfig
from fastdraft.actor.samples import actor_samples, row_hidden
from fastdraft.algo.answer_scores import AnswerScores, ScoreSpec
from fastdraft.algo.sequences import build_batch
from fastdraft.databuffer import DataBuffer
from fastdraft.models import load_model
from fastdraft.trainer.collector import SampleCollector

AUX = (0, 1)


def test_the_actors_forward_gives_the_samples_the_engine_captures(tiny_checkpoint,
                                                                     random_drafter) -> None:
    path, _ = tiny_checkpoint
    engine = RolloutEngine(path, max_batch_size=6, max_seq_len=96, drafter=random_drafter,
                           spec=SpecConfig(method="eagle", depth=3, topk=2, tokens_to_verify=4),
                           capture_aux_layers=AUX)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 64) for _ in range(rng.randrange(4, 10))] for _ in range(6)]
    buffer = DataBuffer(2**24)
    collector = SampleCollector(buffer)
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, seed=0, max_new_tokens=30),
                           on_hidden=collector, on_finish=collector.on_finish)
    captured = {s.request_index: s for s in buffer.samples()}
    # The update batch: every other request (as skipped groups leave it), in another order.
    keep = [4, 0, 2]
    batch = build_batch([outs[i].prompt_token_ids for i in keep],
                        [outs[i].token_ids for i in keep], [outs[i].logprobs for i in keep],
                        [0.0] * len(keep))
    policy = load_model(path)
    scores = AnswerScores(batch, ScoreSpec(temperature=1.0))   # the actor's packed forward
    with torch.no_grad():
        _, _, hidden = scores.forward(policy, AUX)
    rows = dict(enumerate(row_hidden(batch, hidden, scores.row_states)))
    rewards = [0.1 * i for i in range(len(outs))]
    samples = actor_samples(batch, rows, keep, [rewards[i] for i in keep], rl_step=3,
                            policy_version=7)
    assert [s.request_index for s in samples] == keep
    for s in samples:
        ref = captured[s.request_index]
        assert (s.rl_step, s.policy_version, s.reward) == (3, 7, rewards[s.request_index])
        assert torch.equal(s.token_ids, ref.token_ids) and torch.equal(s.positions,
                                                                        ref.positions)
        assert torch.equal(s.loss_mask, ref.loss_mask)
        assert s.hidden.dtype == ref.hidden.dtype == torch.bfloat16
        for mine, theirs in zip((s.hidden, *s.aux_hidden), (ref.hidden, *ref.aux_hidden),
                                strict=True):
            torch.testing.assert_close(mine.float(), theirs.float(), rtol=0.02, atol=0.02)
    with pytest.raises(ValueError, match="hidden states of"):   # a row cut to another length
        short = {0: rows[0].__class__(rows[0].final[:-1], rows[0].aux)}
        actor_samples(batch, short, keep, [0.0] * 3, 0, 0)


@pytest.mark.slow
@pytest.mark.parametrize("kind, extra", [
    ("eagle1", []),
    # the miniature's shape: EAGLE-3 (aux layers), 2 FSDP2 ranks, bf16 compute
    ("eagle3", ["actor.num_ranks=2", "actor.compute_dtype=bfloat16", "model.dtype=bfloat16"])])
def test_a_run_trains_its_drafter_on_the_actors_samples(char_policy, char_drafter, char_eagle3,
                                                        tmp_path, kind, extra) -> None:
    from fastdraft.config import load_recipe
    from fastdraft.run.loop import train
    from fastdraft.run.run import Run
    drafter = char_drafter if kind == "eagle1" else char_eagle3
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nmodel:\n  path: {char_policy}\ndrafter:\n  path: {drafter}\n"
                      "  online:\n    enabled: true\n    source: actor\n    token_budget: 64\n"
                      "    min_steps_per_step: 2\nrollout:\n  prompts_per_step: 4\n"
                      "  group_size: 4\n  max_new_tokens: 12\n  spec:\n    method: eagle\n"
                      "    depth: 3\n    topk: 2\n    tokens_to_verify: 4\nalgorithm:\n"
                      "  num_steps: 3\n  skip_zero_variance: true\ndata:\n  task_pool: 4\n")
    cfg = load_recipe(recipe, [*extra, "logging.wandb.mode=disabled", "logging.dashboard=false",
                               "drafter.export=false", f"drafter.kind={kind}"])
    run = Run(cfg, tmp_path / "run")
    assert run.drafter.on_hidden is None   # the engine captures nothing
    # Rewards with variance in groups 0 and 1 only: groups 2 and 3 leave the update batch.
    calls = itertools.count()
    run.prompts.score = lambda item, text: float(next(calls) % 16 in (0, 4))
    try:
        train(run)
    finally:
        run.close_after_failure()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    # Every step's 16 rollouts reached the trainer: the update batch's rows from its forward,
    # the skipped groups' (zero variance) from a forward of their own; it trained on them.
    assert [r["actor/trained_samples"] for r in rows] == [8.0] * 3
    assert [r["drafter/samples_added"] for r in rows] == [16.0] * 3
    assert all(r["drafter/train_tokens"] > 0 for r in rows)
    assert [r["drafter/version"] for r in rows] == sorted({r["drafter/version"] for r in rows})
