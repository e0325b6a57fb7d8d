"""Bootstrap policy: data encoding (loss mask), batching, LR schedule and the training loop."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from fastdraft.bootstrap.policy import (
    EOS_ID,
    IGNORE_INDEX,
    BootstrapSpec,
    batch_stream,
    collate,
    encode_example,
    encode_prompt,
    init_weights,
    lr_at,
    model_config,
    train_policy,
)
from fastdraft.bootstrap.tokenizer import build_char_tokenizer
from fastdraft.data.tasks import get_task
from fastdraft.data.tasks.modsum import make_problem
from fastdraft.models import CausalLM

TINY = BootstrapSpec(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                     num_kv_heads=1, steps=25, batch_size=16, lr=1e-2, warmup_steps=2,
                     bucket_batches=2, num_heldout=8, eval_batch_size=8, max_new_tokens=16)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    path: Path = tmp_path_factory.mktemp("char-tok")
    build_char_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def test_loss_mask_covers_exactly_solution_and_eos(tokenizer) -> None:
    problem = make_problem([7, 3, 9, 4])  # "7+3+9+4=" -> "7,0,9,3#3"
    ex = encode_example(tokenizer, problem)
    prompt = encode_prompt(tokenizer, problem.prompt)
    solution = tokenizer.encode(problem.solution, add_special_tokens=False)
    assert ex.input_ids == prompt + solution + [EOS_ID]
    assert len(ex.labels) == len(ex.input_ids)
    scored = [t for t, label in enumerate(ex.labels) if label != IGNORE_INDEX]
    # Position t predicts token t+1: the scored targets are exactly solution + EOS, in order.
    assert scored == list(range(len(prompt) - 1, len(ex.input_ids) - 1))
    assert [ex.labels[t] for t in scored] == [*solution, EOS_ID]
    assert all(ex.labels[t] == ex.input_ids[t + 1] for t in scored)
    assert tokenizer.decode([ex.labels[t] for t in scored][:-1]) == problem.solution


def test_prompt_encoding_is_the_plain_tokenizer(tokenizer) -> None:
    """Consumers that tokenize prompts themselves must get what the policy was trained on."""
    prompt = "7+3+9+4="
    assert encode_prompt(tokenizer, prompt) == tokenizer(prompt).input_ids
    assert len(encode_prompt(tokenizer, prompt)) == len(prompt)


def test_collate_right_pads_with_ignored_labels(tokenizer) -> None:
    short = encode_example(tokenizer, make_problem([1, 2, 3]))
    long = encode_example(tokenizer, make_problem([1, 2, 3, 4, 5]))
    batch = collate([short, long])
    assert batch.input_ids.shape == batch.labels.shape == (2, len(long.input_ids))
    pad = len(short.input_ids)
    assert (batch.input_ids[0, pad:] == 0).all()
    assert (batch.labels[0, pad:] == IGNORE_INDEX).all()
    assert batch.labels[1].tolist() == long.labels
    assert batch.positions[1].tolist() == list(range(len(long.input_ids)))


def test_batch_stream_is_deterministic_bucketed_and_skips_excluded(tokenizer) -> None:
    task = get_task("modsum")
    rng = random.Random(3)
    excluded = frozenset(task.sample(rng).prompt for _ in range(20))
    first = batch_stream(task, tokenizer, TINY, random.Random(3), excluded)
    again = batch_stream(task, tokenizer, TINY, random.Random(3), excluded)
    for _ in range(2):  # two pools of TINY.bucket_batches == 2 batches each
        pool = [next(first), next(first)]
        for batch in pool:
            assert torch.equal(batch.input_ids, next(again).input_ids)
        # Sorted pools: a batch holds a contiguous length range, so it pads to similar lengths.
        ranges = sorted([((b.labels != IGNORE_INDEX).sum(1).min().item(),
                          (b.labels != IGNORE_INDEX).sum(1).max().item()) for b in pool])
        assert ranges[0][1] <= ranges[1][0]
        for batch in pool:
            texts = tokenizer.batch_decode(batch.input_ids, skip_special_tokens=True)
            assert not {t.split("=")[0] + "=" for t in texts} & excluded


def test_batch_stream_thins_long_problems_only(tokenizer) -> None:
    task = get_task("modsum")

    def lengths(spec: BootstrapSpec) -> list[int]:
        stream = batch_stream(task, tokenizer, spec, random.Random(5))
        batches = [next(stream) for _ in range(8 * spec.bucket_batches)]
        return [n for b in batches for n in (b.input_ids != 0).sum(1).tolist()]

    full = lengths(replace(TINY, thin_keep=1.0))
    thin = lengths(replace(TINY, thin_above_tokens=22, thin_keep=0.2))
    long_full = sum(n > 22 for n in full) / len(full)
    long_thin = sum(n > 22 for n in thin) / len(thin)
    assert long_full > 0.25  # modsum: ~42% of problems have more than 5 terms (> 22 tokens)
    assert long_thin < 0.5 * long_full and sum(n > 22 for n in thin) > 0  # rarer, not gone
    with pytest.raises(ValueError, match="thin_keep"):
        BootstrapSpec(thin_keep=0.0)


def test_lr_warms_up_then_decays_to_floor() -> None:
    spec = BootstrapSpec(steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, spec) == pytest.approx(1e-4)
    assert lr_at(9, spec) == pytest.approx(1e-3)
    assert lr_at(50, spec) < lr_at(20, spec) < 1e-3
    assert lr_at(99, spec) == pytest.approx(1e-4)


def test_spec_rejects_bad_values_and_digest_tracks_spec_and_seed() -> None:
    with pytest.raises(ValueError, match="num_heads"):
        BootstrapSpec(hidden_size=30, num_heads=4)
    with pytest.raises(ValueError, match="warmup_steps"):
        BootstrapSpec(steps=10, warmup_steps=10)
    assert TINY.digest(0) == BootstrapSpec(**{f: getattr(TINY, f) for f in TINY.__slots__}
                                           ).digest(0)
    assert TINY.digest(0) != TINY.digest(1)
    assert TINY.digest(0) != BootstrapSpec().digest(0)


def test_model_config_is_small_qwen2() -> None:
    cfg = model_config(BootstrapSpec())
    assert cfg.model_type == "qwen2" and cfg.vocab_size == 64
    assert cfg.eos_token_ids == (1,) and cfg.bos_token_id == 2
    assert cfg.max_position_embeddings >= 256
    assert cfg.num_attention_heads > cfg.num_key_value_heads  # GQA


def test_training_loop_decreases_loss(tokenizer) -> None:
    torch.manual_seed(0)
    model = CausalLM(model_config(TINY))
    init_weights(model)
    short = get_task("modsum", max_terms=6)  # short sequences keep the test fast
    batches = batch_stream(short, tokenizer, TINY, random.Random(0))
    result = train_policy(model, batches, TINY, log=lambda _: None)
    assert len(result.losses) == TINY.steps and result.tokens > 0
    start, end = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert start > 3.5  # ~ln(64) at init: HF-style init, not huge random logits
    assert end < 0.75 * start
    assert not model.training
