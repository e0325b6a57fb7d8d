"""The bootstrap trains bit-identical weights for a spec and seed: twice in one process (whatever
the caller did to RNGs and threads in between) and once more in a fresh interpreter."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from fastdraft.bootstrap.determinism import deterministic_cpu, weights_digest
from fastdraft.bootstrap.policy import BootstrapSpec, train_bootstrap
from fastdraft.bootstrap.tokenizer import build_char_tokenizer

# Tiny but not trivial: 2 layers, GQA, bucketed batches of mixed lengths, warmup + cosine.
TINY = BootstrapSpec(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, steps=6, batch_size=16, lr=1e-2, warmup_steps=2,
                     bucket_batches=2, num_heldout=16)

# Trains TINY (passed as JSON) in a fresh interpreter and prints the weights digest.
_CHILD = """
import json, sys, tempfile
from transformers import AutoTokenizer
from fastdraft.bootstrap.determinism import weights_digest
from fastdraft.bootstrap.policy import BootstrapSpec, train_bootstrap
from fastdraft.bootstrap.tokenizer import build_char_tokenizer
with tempfile.TemporaryDirectory() as tmp:
    build_char_tokenizer(tmp)
    tokenizer = AutoTokenizer.from_pretrained(tmp)
model, _ = train_bootstrap(BootstrapSpec(**json.loads(sys.argv[1])), int(sys.argv[2]), tokenizer,
                           log=lambda _: None)
print("DIGEST", weights_digest(model))
"""


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    path: Path = tmp_path_factory.mktemp("char-tok")
    build_char_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def _train_digest(tokenizer, seed: int = 0) -> str:
    model, result = train_bootstrap(TINY, seed, tokenizer, log=lambda _: None)
    assert len(result.losses) == TINY.steps
    return weights_digest(model)


def _child_digest(seed: int) -> str:
    # Another hash seed and thread count in the environment: neither may change the weights.
    env = {**os.environ, "PYTHONHASHSEED": "12345", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(asdict(TINY)), str(seed)],
                         env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("DIGEST"))


def test_same_seed_gives_bit_identical_weights_in_process_and_in_a_fresh_one(tokenizer) -> None:
    first = _train_digest(tokenizer)
    # Disturb everything a caller might have touched; none of it may reach the weights.
    threads = torch.get_num_threads()
    torch.manual_seed(1234)
    random.seed(1234)
    torch.set_num_threads(1 if TINY.num_threads != 1 else 2)
    try:
        second = _train_digest(tokenizer)
    finally:
        torch.set_num_threads(threads)
    assert first == second, "two trainings in one process gave different weights"
    assert _child_digest(0) == first, "a fresh process trained different weights"


def test_digest_tells_seeds_apart_and_training_leaves_caller_state_alone(tokenizer) -> None:
    torch.manual_seed(7)
    expected_next = torch.rand(3)
    torch.manual_seed(7)
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    other = _train_digest(tokenizer, seed=1)
    assert torch.equal(torch.rand(3), expected_next)  # the global torch RNG was not consumed
    assert torch.get_num_threads() == threads
    assert torch.are_deterministic_algorithms_enabled() == det
    assert other != _train_digest(tokenizer, seed=0)


def test_deterministic_cpu_pins_then_restores_settings() -> None:
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    with deterministic_cpu(1):
        assert torch.get_num_threads() == 1
        assert torch.are_deterministic_algorithms_enabled()
    assert torch.get_num_threads() == threads
    assert torch.are_deterministic_algorithms_enabled() == det
    with pytest.raises(ValueError, match="num_threads"), deterministic_cpu(0):
        pass


def test_weights_digest_sees_one_flipped_bit() -> None:
    model = torch.nn.Linear(4, 3)
    before = weights_digest(model)
    assert weights_digest(model) == before
    with torch.no_grad():
        flat = model.weight.view(-1)
        flat[5] = torch.nextafter(flat[5], torch.tensor(float("inf")))
    assert weights_digest(model) != before


def test_an_attempt_still_on_the_plateau_restarts_from_a_fresh_init(tokenizer) -> None:
    """Dev exact match below restart_below at restart_after abandons the attempt; the last
    attempt trains its full steps; the outcome is as deterministic as a single attempt."""
    spec = replace(TINY, check_every=2, restart_after=4, restart_below=1.0,
                   stop_at_short_accuracy=1.0, max_attempts=3)
    runs = [train_bootstrap(spec, 0, tokenizer, log=lambda _: None) for _ in range(2)]
    for _, result in runs:
        assert result.attempts == 3
        assert len(result.losses) == 4 + 4 + spec.steps
    assert weights_digest(runs[0][0]) == weights_digest(runs[1][0])
    single, _ = train_bootstrap(replace(spec, max_attempts=1), 0, tokenizer, log=lambda _: None)
    assert weights_digest(single) != weights_digest(runs[0][0])   # a fresh init, not attempt 1
